"""One decode step of the real model, outside the engine: what the CPU profile and the step-time sweep time.

``DecodeStepBench`` loads the weights as the engine would (same loader, dtype
and weight precision), allocates a KV cache for ``max_rows`` requests of
``context`` tokens, and builds the ``ForwardBatch`` of a pure decode step: every
row is one token at position ``context - 1`` with its own block table, as in the
middle of a batch's generation. ``step(rows)`` runs the forward and greedy
sampling the way ``TorchStep.compute`` does (the engine's planner, staging and
threads are left out: on the CPU they cost ~1 ms of a 50-400 ms step).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.llama import CausalLM
from asyncbatch.model.loader import load_model, resolve_dtype, resolve_model_path
from asyncbatch.model.quantization import weight_bytes
from asyncbatch.sampling.sampler import SamplingTensors, sample

BLOCK_SIZE = 16


@dataclass(slots=True)
class StepTiming:
    """Wall time per step, and this process's CPU time per step (all its threads). On a shared machine the
    CPU time moves far less with other people's jobs; with one torch thread it is the step's own work."""

    rows: int
    median_ms: float
    min_ms: float
    samples_ms: list[float]
    cpu_median_ms: float = 0.0


def decode_batch(rows: int, context: int, block_size: int = BLOCK_SIZE, vocab: int = 256,
                 seed: int = 0) -> ForwardBatch:
    """A pure decode step: ``rows`` rows of context ``context``, row ``r`` owning blocks ``1 + r * n ...``
    (block 0 is the engine's dummy block)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-context // block_size)
    tables = 1 + torch.arange(rows * per_row, dtype=torch.int64).view(rows, per_row)  # [R, blocks]
    pos = context - 1
    slot = tables[:, pos // block_size] * block_size + pos % block_size  # [R]
    return ForwardBatch(input_ids=torch.randint(0, vocab, (rows,), generator=gen),
                        positions=torch.full((rows,), pos, dtype=torch.int64), slot_mapping=slot,
                        num_decode=rows, decode_block_tables=tables,
                        decode_context_lens=torch.full((rows,), context, dtype=torch.int64), prefill_rows=[],
                        logits_indices=torch.arange(rows))


def greedy_sampling(rows: int) -> SamplingTensors:
    return SamplingTensors(temperature=torch.zeros(rows), top_k=torch.zeros(rows, dtype=torch.int64),
                           top_p=torch.ones(rows), min_p=torch.zeros(rows),
                           seed=torch.zeros(rows, dtype=torch.int64), step=torch.zeros(rows, dtype=torch.int64))


class DecodeStepBench:
    def __init__(self, model: str | None = None, dtype: str = "float32", quantization: str | None = None,
                 max_rows: int = 128, context: int = 128, threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        path = resolve_model_path(model)
        self.dtype = resolve_dtype(dtype, "cpu")
        self.context = context
        self.model: CausalLM = load_model(path, self.dtype, torch.device("cpu"), max_positions=max(context, 1),
                                          quantization=quantization)
        blocks = 1 + max_rows * -(-context // BLOCK_SIZE)
        self.kv_caches = self.model.new_kv_caches(blocks, BLOCK_SIZE)
        self.vocab = int(self.model.config.vocab_size)

    def step(self, rows: int) -> torch.Tensor:
        batch = decode_batch(rows, self.context, vocab=self.vocab)
        with torch.inference_mode():
            logits = self.model(batch, self.kv_caches)  # [R, vocab]
            return sample(logits, greedy_sampling(rows), all_greedy=True).token_ids

    def time_steps(self, rows: int, repeats: int = 5, warmup: int = 1) -> StepTiming:
        for _ in range(warmup):
            self.step(rows)
        samples, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            self.step(rows)
            samples.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
        return StepTiming(rows, statistics.median(samples), min(samples), samples, statistics.median(cpu))

    def weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads in full (``quantization.weight_bytes``)."""
        return weight_bytes(self.model)

    def kv_bytes(self, rows: int) -> int:
        """Bytes of keys and values a decode step of ``rows`` rows reads (every layer, the whole context)."""
        k, _v = self.kv_caches[0]
        per_token = 2 * k.shape[2] * k.shape[3] * k.element_size() * len(self.kv_caches)
        return rows * self.context * per_token


def steps_against_floor(bench: DecodeStepBench, rows_list: list[int], pairs: int = 7) -> dict:
    """Per row count: the greedy tokens of one step, then ``pairs`` pairs of (the floor: the step's weight bytes
    at the read rate of the best of three ``sum()`` passes over 512 MiB; the median of five steps), one right after
    the other, so that each step time has the floor of its own moment; the medians of the steps, of the floors and
    of the pairs' ratios (``tokens``, ``ms``, ``floor_ms``, ``ratio``, each keyed by the row count)."""
    ones = torch.ones(512 * 2**20 // 4)
    step_bytes = bench.weight_bytes()

    def floor_ms() -> float:
        passes = []
        for _ in range(3):
            t0 = time.perf_counter()
            ones.sum()
            passes.append(time.perf_counter() - t0)
        return step_bytes / (ones.nbytes / min(passes)) * 1e3

    out: dict = {"tokens": {}, "ms": {}, "floor_ms": {}, "ratio": {}}
    for rows in rows_list:
        out["tokens"][rows] = bench.step(rows).tolist()
        bench.time_steps(rows, repeats=3, warmup=3)
        measured = [(floor_ms(), bench.time_steps(rows, repeats=5, warmup=1).median_ms) for _ in range(pairs)]
        out["ms"][rows] = statistics.median(ms for _, ms in measured)
        out["floor_ms"][rows] = statistics.median(f for f, _ in measured)
        out["ratio"][rows] = statistics.median(ms / f for f, ms in measured)
    return out

