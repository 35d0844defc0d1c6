"""The engine's captured decode step and the CUDA executor's host logic, on CPU.

``DecodeGraphStep`` on a tiny model, through ``GraphRunner`` with ``EagerBackend``,
against the eager executor path; and ``CudaExecutor`` itself with no-op streams
and events inside a whole engine. ``tests/test_cuda_path.py`` reuses the
prefilled state and step writer defined here on a real GPU.
"""

from __future__ import annotations

import contextlib
import time
import types

import numpy as np
import pytest
import torch
from tiny_models import save_tiny_model

from asyncbatch import LLM, SamplingParams
from asyncbatch.engine.block_manager import DUMMY_BLOCK
from asyncbatch.engine.host_staging import StagingBuffer
from asyncbatch.engine.step_metadata import StepMeta
from asyncbatch.executors.decode_graph import DecodeGraphStep, SamplingVariant
from asyncbatch.executors.torch_executor import TorchExecutor
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.loader import load_model
from cuda_graphs import (
    EagerBackend,
    GraphRunner,
)

# -- the engine's decode step ---------------------------------------------------------------------------
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, MAX_BLOCKS = 4, 48, 8, 8
PROMPT_LENS = (5, 9, 2, 7, 4)
REQUEST_ROWS = (0, 2, 5, 6, 3)  # token-buffer rows: not contiguous, not in row order


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM")
    return load_model(path, torch.float32, torch.device("cpu"), max_positions=BLOCK_SIZE * MAX_BLOCKS)


def prefilled_state(model):
    """KV caches and token buffer (on the model's device) after prefilling every prompt, and the block tables."""
    device = model.output_weight.device
    kv_shape = (NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    g = torch.Generator().manual_seed(0)
    caches = [(torch.zeros(kv_shape, device=device), torch.zeros(kv_shape, device=device))
              for _ in model.model.layers]
    tables = np.zeros((len(PROMPT_LENS), MAX_BLOCKS), dtype=np.int64)
    free = iter(range(NUM_BLOCKS - 1, DUMMY_BLOCK, -1))
    for i in range(len(PROMPT_LENS)):
        tables[i] = [next(free) for _ in range(MAX_BLOCKS)]
    ids, pos, slots, rows, start = [], [], [], [], 0
    for i, n in enumerate(PROMPT_LENS):
        ids += torch.randint(3, 250, (n,), generator=g).tolist()
        pos += list(range(n))
        slots += [tables[i, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]
        rows.append(PrefillRow(start, n, n, torch.from_numpy(tables[i, :-(-n // BLOCK_SIZE)]).to(device)))
        start += n
    last = [r.token_start + r.q_len - 1 for r in rows]
    i64 = {"dtype": torch.int64, "device": device}
    batch = ForwardBatch(torch.tensor(ids, **i64), torch.tensor(pos, **i64), torch.tensor(slots, **i64), 0,
                         torch.zeros(0, 1, **i64), torch.zeros(0, **i64), rows, torch.tensor(last, **i64))
    with torch.inference_mode():
        first = model(batch, caches).argmax(dim=-1)
    token_buffer = torch.zeros(MAX_SEQS + 1, **i64)
    token_buffer[list(REQUEST_ROWS)] = first
    return caches, token_buffer, tables


def write_decode_rows(staging: StagingBuffer, tables: np.ndarray, n: int, step: int, temps: list[float], top_k: int) -> StepMeta:
    """What the planner writes for a decode-only step of the first ``n`` requests."""
    pos = np.array([PROMPT_LENS[i] + step for i in range(n)])
    staging.decode_token_rows[:n] = REQUEST_ROWS[:n]
    staging.positions[:n] = pos
    staging.slot_mapping[:n] = tables[np.arange(n), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    staging.decode_block_tables[:n] = tables[:n]
    staging.decode_context_lens[:n] = pos + 1
    staging.logits_indices[:n] = np.arange(n)
    staging.sample_token_rows[:n] = REQUEST_ROWS[:n]
    staging.sample_temperature[:n] = temps[:n]
    staging.sample_top_k[:n] = top_k
    staging.sample_top_p[:n], staging.sample_min_p[:n] = 1.0, 0.0
    staging.sample_seed[:n] = np.arange(n) * 7 + 1
    staging.sample_step[:n] = step
    width = int((pos // BLOCK_SIZE + 1).max())
    greedy = all(t == 0 for t in temps[:n])
    return StepMeta(step, staging, n, n, width, [], n, int(pos.sum()) + n, greedy, top_k > 0 and not greedy,
                    False, [])


@pytest.mark.parametrize("temps,top_k,variant", [
    ([0.0] * 5, 0, SamplingVariant.GREEDY),
    ([0.0, 0.9, 1.3, 0.0, 0.7], 0, SamplingVariant.SAMPLE),
    ([0.8, 0.9, 1.3, 0.0, 0.7], 20, SamplingVariant.FILTERED),
], ids=["greedy", "sample", "filtered"])
def test_decode_graph_step_matches_eager_path(tiny_model, temps, top_k, variant):
    caches, token_buffer, tables = prefilled_state(tiny_model)
    eager = TorchExecutor(tiny_model, [(k.clone(), v.clone()) for k, v in caches], MAX_SEQS, torch.device("cpu"))
    eager.token_buffer.copy_(token_buffer)
    graph_caches = [(k.clone(), v.clone()) for k, v in caches]
    graph_tokens = token_buffer.clone()
    step = DecodeGraphStep(tiny_model, graph_caches, graph_tokens, max_rows=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS)
    runner = GraphRunner(step, (1, 2, 4, 8), 2, torch.device("cpu"), EagerBackend(), warmup=0)
    buffers = [StagingBuffer.allocate(i, 16, MAX_SEQS, MAX_BLOCKS, pinned=False) for i in range(2)]
    try:
        for step_index, n in enumerate([5, 5, 3, 4, 1]):  # the batch shrinks and grows within buckets
            staging = buffers[step_index % 2]
            meta = write_decode_rows(staging, tables, n, step_index, temps, top_k)
            chosen = SamplingVariant.for_step(meta)
            assert chosen is (variant if any(temps[:n]) else SamplingVariant.GREEDY)
            with torch.inference_mode():
                eager_out = eager._compute(meta, eager._copy_in(meta))
                want, want_finite = eager_out.token_ids, eager_out.finite
                bucket = runner.bucket_for(n)
                runner.capture(staging.index, bucket, chosen, lazy=True)  # on first use: resets the set to padding
                runner.prepare(staging.index, step.host_arrays(staging), n, bucket)
                out = runner.replay(staging.index, bucket, chosen)
            assert out["token_ids"][:n].tolist() == want.tolist(), step_index
            assert out["finite"][:n].all() and want_finite.all()
            assert np.all(staging.decode_block_tables[n:bucket] == DUMMY_BLOCK)
            assert np.all(staging.decode_token_rows[n:bucket] == step.dummy_token_row)
    finally:
        eager.close()
    real_rows = list(range(MAX_SEQS))
    assert torch.equal(graph_tokens[real_rows], eager.token_buffer[real_rows])
    for (gk, gv), (ek, ev) in zip(graph_caches, eager.kv_caches):
        # Real blocks agree (to rounding: a GEMM over a padded batch may block its sums differently);
        # only the dummy block holds what padding rows wrote.
        torch.testing.assert_close(gk[DUMMY_BLOCK + 1:], ek[DUMMY_BLOCK + 1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv[DUMMY_BLOCK + 1:], ev[DUMMY_BLOCK + 1:], rtol=1e-5, atol=1e-5)
        assert torch.all(ek[DUMMY_BLOCK] == 0) and gk[DUMMY_BLOCK].abs().sum() > 0


# -- the CUDA executor's host logic -----------------------------------------------------------------------
class _NoStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


class _NoEvent:
    """Completes when recorded, at the host time it was recorded (work runs in program order here)."""

    def __init__(self, *args, **kwargs) -> None:
        self.time: float | None = None

    def record(self, stream=None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        assert self.time is not None, "waited on an event that was never recorded"

    def query(self) -> bool:
        return self.time is not None

    def elapsed_time(self, other) -> float:
        return (other.time - self.time) * 1e3


@pytest.fixture
def cuda_host_shim(monkeypatch):
    """Build ``CudaExecutor`` on the CPU: streams and events are no-ops, memory is not pinned, graphs run
    through ``EagerBackend`` and attention through the torch reference. Its planning, padding, graph
    choice, lazy capture, copies and bookkeeping then run for real, in program order (so this alone says
    nothing about stream ordering: ``test_stream_order`` checks that with a happens-before checker, and
    ``test_cuda_path`` on a GPU). Returns the executor's settings: empty means the plain CPU executor."""
    from asyncbatch.executors import cuda_executor, torch_executor
    from asyncbatch.model import paged_attention

    for name, fake in (("Stream", _NoStream), ("Event", _NoEvent), ("stream", lambda s: contextlib.nullcontext()),
                       ("synchronize", lambda *args, **kwargs: None)):
        monkeypatch.setattr(torch.cuda, name, fake)
    reference = types.SimpleNamespace(paged_attention=paged_attention.reference_attention,
                                      decode_kernel=lambda: "torch reference")
    monkeypatch.setattr(paged_attention, "triton_kernels", lambda device: reference)
    monkeypatch.setattr(cuda_executor, "triton_kernels", lambda device: reference)
    monkeypatch.setattr(cuda_executor, "CudaGraphBackend", lambda device: EagerBackend())

    class HostShim(cuda_executor.CudaExecutor):
        def _check_device(self, device):
            pass

        @staticmethod
        def _pinned(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype)

    settings: dict = {}
    cpu_executor = torch_executor.TorchExecutor

    def build(model, kv_caches, max_num_seqs, device, **cpu_only):  # cpu_only: e.g. dtype_choice
        if not settings:
            return cpu_executor(model, kv_caches, max_num_seqs, device, **cpu_only)
        return HostShim(model, kv_caches, max_num_seqs, device, **settings)

    monkeypatch.setattr(torch_executor, "TorchExecutor", build)  # what engine_builder constructs on "cpu"
    return settings


def shim_workload():
    """Greedy, seeded, filtered and penalised requests, chunked prefill; filtered ones run longest, so the
    last steps are decode-only filtered steps (a graph variant captured on first use)."""
    prompts = [[3 + (i * 37 + j * 11) % 250 for j in range(3 + 7 * i)] for i in range(8)]
    kinds = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=14, temperature=0.9, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True),
             SamplingParams(max_tokens=8, temperature=0.7, repetition_penalty=1.3, seed=3, ignore_eos=True)]
    return prompts, [kinds[i % 4] for i in range(8)]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_cuda_executor_host_logic_matches_cpu_executor(tmp_path, cuda_host_shim, overlap, monkeypatch):
    from asyncbatch.executors import cuda_executor

    monkeypatch.setattr(cuda_executor, "REANCHOR_MS", 0.0)  # event times re-anchored after every step
    path = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM")
    prompts, params = shim_workload()
    runs, infos, records = {}, {}, {}
    for name, settings in (("cpu", {}), ("eager", {"enable_cuda_graphs": False}),
                           ("graphs", {"enable_cuda_graphs": True, "cuda_graph_batch_sizes": (1, 2, 4)})):
        cuda_host_shim.clear()
        cuda_host_shim.update(settings)
        with LLM(str(path), device="cpu", dtype="float32", engine_process=False, max_num_seqs=6, max_num_batched_tokens=32, block_size=4,
                 overlap=overlap, debug_check_integrity=True) as llm:
            runs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            infos[name] = llm._core.executor.describe()
            records[name] = llm.timeline.window()
            llm.check_integrity()
    assert runs["eager"] == runs["cpu"] and runs["graphs"] == runs["cpu"]
    for name in ("eager", "graphs"):  # event times mapped back onto the host clock, re-anchored every step
        for r in records[name]:  # here the "device" runs inside launch, after the fence
            assert r.fence_end - 1e-4 <= r.device_start <= r.device_end <= r.launch_end + 1e-4, r
    assert infos["eager"]["cuda_graphs"] is False
    stats = infos["graphs"]["cuda_graph_stats"]
    assert stats["num_graphs"] == 2 * 3 * 2 + stats["lazy_captures"]  # sets x buckets x (greedy, sample)
    assert stats["lazy_captures"] > 0 and stats["replays"] > 10
