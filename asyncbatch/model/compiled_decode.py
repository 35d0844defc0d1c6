"""The decode-only forward compiled with ``torch.compile`` (inductor, C++ on the CPU): the ``compile_decode``
engine argument.

At one row a CPU decode step is mostly per-op overhead (~1,000 small torch ops at the top level: norms, rotation, the
paged-attention gather and mask, residuals, the ``w8a8`` wrapper's row scaling) rather than weight
reads. Inductor fuses those ops into a few C++ loops and runs the step as one graph, the linears staying
library calls (``mm`` for float weights, fbgemm through ``asyncbatch::w8a8_linear`` for ``w8a8``).

Only pure decode steps (every token a one-token row) take the compiled graph; a step with a prefill
chunk runs the eager model. The row count and the block-table width are dynamic, so one graph serves
every batch of 2 or more rows and a second graph one-row steps; ``warm_up`` compiles both before the
engine takes requests, writing only into the KV cache's dummy block 0. With ``w8a8`` a row's logits do
not depend on the other rows (the tests check one row alone against the same row among five).
They differ from the eager path's in the last bits (inductor sums RMSNorm's squares in another order):
greedy tokens equal the eager path's on the tests' tiny models; with ``w8a8`` a last-bit difference can
move an activation across an int8 rounding boundary, so on a real model greedy tokens can part from the
eager path's after a near-tie (docs/cpu-precision.md).
"""

from __future__ import annotations

import os
import shutil
import time
from inspect import signature

import torch
import torch.nn.functional as F

from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.llama import CausalLM

COMPILE_DECODE_QUANTIZATIONS = (None, "w8a8")
CXX_NAMES = ("g++", "c++", "clang++")  # inductor's default is g++
RECOMPILE_LIMIT = 64
# Dynamo gives a dimension of size 1 a graph of its own. One-row steps keep theirs (faster than the dynamic
# graph on two rows with one dropped: w8a8 24.2 vs 35.4 ms of CPU, the same logits bit for bit); block tables
# one block wide are padded to 2 (no more graphs).
MIN_SIZE = 2


def check_compile_decode(compile_decode: bool, device: str, quantization: str | None) -> None:
    """``ValueError`` naming ``compile_decode`` for a combination the compiled path does not run."""
    if not compile_decode:
        return
    if device != "cpu":
        raise ValueError(f"compile_decode=True runs on the cpu device only, got device={device!r} "
                         "(the cuda device captures decode steps in CUDA graphs instead)")
    if quantization not in COMPILE_DECODE_QUANTIZATIONS:
        raise ValueError(f"compile_decode=True supports quantization None or 'w8a8', got {quantization!r} "
                         "(torch's int8/int4 packed kernels are not traced)")
    if cxx_compiler() is None:
        raise ValueError("compile_decode=True needs a C++ compiler for torch.compile's CPU backend "
                         f"(one of {CXX_NAMES} on PATH, or $CXX); none was found")


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would find, or None (then its CPU backend cannot build a kernel)."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else []
    return next((path for name in (*candidates, *CXX_NAMES) if (path := shutil.which(name))), None)


def is_pure_decode(batch: ForwardBatch) -> bool:
    return not batch.prefill_rows and batch.num_decode > 0 and batch.num_decode == batch.input_ids.shape[0]


class CompiledDecode:
    """``model(batch, kv_caches)`` for pure decode batches: one graph for one row, one for any other count."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.compile_seconds = 0.0
        # Every instance's graphs are cached on the one code object of ``_forward`` (two per engine: one row,
        # and any row count), up to dynamo's recompile limit (8 by default): room for a test's engines.
        limit = {"recompile_limit": RECOMPILE_LIMIT} if "recompile_limit" in signature(torch.compile).parameters else {}
        self._compiled = torch.compile(self._forward, fullgraph=True, **limit)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        batch = ForwardBatch(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                             num_decode=input_ids.shape[0], decode_block_tables=block_tables,
                             decode_context_lens=context_lens, prefill_rows=[], logits_indices=logits_indices)
        return self.model(batch, self.kv_caches)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[R, vocab]`` float32 of a pure decode ``batch`` (``is_pure_decode``)."""
        tables = batch.decode_block_tables
        if tables.shape[1] < MIN_SIZE:
            # The extra columns are the dummy block 0, masked by the context length.
            tables = F.pad(tables, (0, MIN_SIZE - tables.shape[1]))
        args = [batch.input_ids, batch.positions, batch.slot_mapping, tables, batch.decode_context_lens,
                batch.logits_indices]
        # Dense row-major copies: the graph is specialised on strides, and ``contiguous()`` keeps a one-row slice
        # of the executor's wider block-table buffer as it is (stride[0] != width), a recompile per step.
        args = [torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t) for t in args]
        for t in args:
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(args[3], 1)
        return self._compiled(*args)

    def warm_up(self, rows: tuple[int, ...] = (1, 2)) -> float:
        """Compile on dummy steps of these row counts that read and write block 0 only; returns the seconds
        spent compiling so far."""
        t0 = time.perf_counter()
        device = self.kv_caches[0][0].device
        for r in rows:
            # Made outside inference mode, like the executor's inputs (guards check the tensors' dispatch keys).
            zeros = torch.zeros(r, dtype=torch.int64, device=device)
            batch = ForwardBatch(input_ids=zeros.clone(), positions=zeros.clone(), slot_mapping=zeros.clone(),
                                 num_decode=r, decode_block_tables=torch.zeros(r, 2, dtype=torch.int64, device=device),
                                 decode_context_lens=torch.ones(r, dtype=torch.int64, device=device),
                                 prefill_rows=[], logits_indices=torch.arange(r, device=device))
            with torch.inference_mode():
                self(batch)
        self.compile_seconds += time.perf_counter() - t0
        return self.compile_seconds
