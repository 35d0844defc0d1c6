"""CUDA-graph bookkeeping on CPU: buckets, padding, static-buffer refill, graph sets, the decode step,
and the CUDA executor's host logic.

Capture itself needs CUDA (``tests/test_cuda_path.py``); here ``EagerBackend``
stands in for it, so everything around capture runs with plain CPU tensors,
including the engine's real decode step on a tiny model against the eager
executor path, and ``CudaExecutor`` itself with no-op streams and events.
"""

from __future__ import annotations

import contextlib
import time
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import save_tiny_model

from asyncbatch import LLM, SamplingParams
from asyncbatch.block_manager import DUMMY_BLOCK
from asyncbatch.executors.decode_graph import DecodeGraphStep, SamplingVariant
from asyncbatch.executors.torch_executor import TorchExecutor
from asyncbatch.host_slots import HostSlot
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.loader import load_model
from asyncbatch.step_metadata import StepMeta
from cuda_graphs import (
    BufferSpec,
    EagerBackend,
    GraphRunner,
    OutputSpec,
    StaticBuffers,
    choose_bucket,
    default_batch_sizes,
    normalize_batch_sizes,
    pad_host_rows,
)


# -- buckets ------------------------------------------------------------------------------
@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 9, 100, 256, 257, 300, 1000])
def test_default_batch_sizes_shape(max_num_seqs):
    sizes = default_batch_sizes(max_num_seqs)
    assert sizes[-1] == max_num_seqs and sizes[0] == 1
    assert list(sizes) == sorted(set(sizes))
    steps = np.diff([s for s in sizes if s != max_num_seqs])
    below = [s for s in sizes if s < max_num_seqs]
    assert [s for s in below if s <= 8] == [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    assert all(d == 8 for s, d in zip(below[1:], steps) if 16 < s <= 256)
    assert all(d == 16 for s, d in zip(below[1:], steps) if s > 256)


@given(st.lists(st.integers(1, 600), min_size=1, max_size=20), st.integers(1, 600))
def test_choose_bucket_is_the_smallest_that_fits(sizes, rows):
    sizes = tuple(sorted(set(sizes)))
    bucket = choose_bucket(sizes, rows)
    fitting = [s for s in sizes if s >= rows]
    assert bucket == (min(fitting) if fitting else None)


def test_default_buckets_pad_little():
    sizes = default_batch_sizes(512)
    pads = [choose_bucket(sizes, n) - n for n in range(1, 513)]
    assert max(pads[:256]) <= 7 and max(pads) <= 15


def test_normalize_batch_sizes():
    assert normalize_batch_sizes(None, 16) == default_batch_sizes(16)
    assert normalize_batch_sizes([8, 1, 8, 512], 64) == (1, 8, 64)  # above max_num_seqs: clamped
    for bad in ([], [0], [2.5], [True]):
        with pytest.raises(ValueError):
            normalize_batch_sizes(bad, 64)
    with pytest.raises(ValueError):
        choose_bucket((1, 2), 0)


# -- padding and static buffers ----------------------------------------------------------------
SPECS = (BufferSpec("ids", (), torch.int64, 99, "host_ids"),
         BufferSpec("table", (3,), torch.int64, 0, "host_table"),
         BufferSpec("temp", (), torch.float32, 0.5, "host_temp"))


def host_arrays(rows: int = 10) -> dict[str, np.ndarray]:
    return {"host_ids": np.arange(rows, dtype=np.int64), "host_table": np.arange(rows * 3).reshape(rows, 3) + 1,
            "host_temp": np.linspace(1, 2, rows).astype(np.float32)}


def test_pad_host_rows_touches_only_the_padding_rows():
    host, before = host_arrays(), host_arrays()
    pad_host_rows(host, SPECS, 3, 6)
    for spec in SPECS:
        arr, old = host[spec.host], before[spec.host]
        np.testing.assert_array_equal(arr[:3], old[:3])
        np.testing.assert_array_equal(arr[6:], old[6:])
        assert np.all(arr[3:6] == spec.pad)
    pad_host_rows(host, SPECS, 4, 4)  # empty range: nothing
    assert host["host_ids"][4] == 99


def test_static_buffers_start_padded_refill_and_reset():
    buffers = StaticBuffers(SPECS, 8, "cpu")
    assert all(torch.all(t == s.pad) for s, t in zip(SPECS, buffers.tensors.values()))
    host = host_arrays()
    addresses = {n: t.data_ptr() for n, t in buffers.tensors.items()}
    buffers.load(host, 5)
    assert {n: t.data_ptr() for n, t in buffers.tensors.items()} == addresses  # fixed addresses
    np.testing.assert_array_equal(buffers.tensors["table"][:5].numpy(), host["host_table"][:5])
    assert torch.all(buffers.tensors["ids"][5:] == 99)  # rows past the copy keep what they held
    views = buffers.views(4)
    assert views["table"].shape == (4, 3) and views["ids"].data_ptr() == addresses["ids"]
    buffers.reset()
    assert torch.all(buffers.tensors["temp"] == 0.5)
    with pytest.raises(ValueError):
        buffers.load(host, 9)
    with pytest.raises(ValueError):
        StaticBuffers((SPECS[0], SPECS[0]), 4, "cpu")


# -- graph sets ----------------------------------------------------------------------------------
class ToyStep:
    """out = ids * scale + the sum of the table row; also counts padding rows it saw."""

    def __init__(self) -> None:
        self.runs = 0

    def input_specs(self):
        return SPECS

    def output_specs(self):
        return (OutputSpec("out", (), torch.int64), OutputSpec("pad", (), torch.bool))

    def run(self, inputs, variant):
        self.runs += 1
        scale = {"double": 2, "triple": 3}[variant]
        return {"out": inputs["ids"] * scale + inputs["table"].sum(dim=1), "pad": inputs["ids"] == 99}


class SharedScratchStep(ToyStep):
    """Returns its results in one scratch tensor that every graph shares, as graphs capturing from one
    memory pool may: what one replay left there, the next replay of any graph overwrites."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = torch.zeros(8, dtype=torch.int64)

    def run(self, inputs, variant):
        result = super().run(inputs, variant)
        rows = result["out"].shape[0]
        self.scratch[:rows] = result["out"]
        return {"out": self.scratch[:rows], "pad": result["pad"]}


def test_graph_runner_bookkeeping():
    backend = EagerBackend()
    runner = GraphRunner(ToyStep(), (1, 2, 4, 8), 2, torch.device("cpu"), backend, warmup=1)
    assert runner.bucket_for(3) == 4 and runner.bucket_for(9) is None and runner.max_rows == 8
    runner.capture_all(["double"])
    assert runner.stats.num_graphs == backend.captures == 8 and runner.stats.lazy_captures == 0
    assert runner.has(1, 8, "double") and not runner.has(1, 8, "triple")
    with pytest.raises(KeyError):
        runner.replay(0, 4, "triple")
    runner.capture(0, 4, "triple", lazy=True)
    runner.capture(0, 4, "triple", lazy=True)  # already there: nothing new
    assert runner.stats.num_graphs == 9 and runner.stats.lazy_captures == 1
    with pytest.raises(ValueError):
        runner.capture(0, 3, "double")  # not a bucket

    host = host_arrays()
    runner.prepare(1, host, 3, 4)
    assert host["host_ids"][3] == 99 and host["host_ids"][4] == 4  # row 3 padded, row 4 untouched
    first = runner.replay(1, 4, "double")
    expected = torch.tensor([0 * 2 + 6, 1 * 2 + 15, 2 * 2 + 24, 99 * 2 + 0])
    assert torch.equal(first["out"], expected) and first["pad"].tolist() == [False, False, False, True]
    host = host_arrays()
    runner.prepare(1, host, 4, 4)  # the next step refills every row of the bucket
    again = runner.replay(1, 4, "double")
    assert again["out"] is first["out"]  # static outputs: the same tensors every replay
    assert not again["pad"].any() and again["out"][3].item() == 3 * 2 + 33
    with pytest.raises(ValueError):
        runner.prepare(0, host, 5, 4)


def test_replay_outputs_survive_the_other_sets_replay():
    """Step N's outputs are copied to the host while step N+1 (the other set) replays: that replay must not
    touch them, even where the graphs' own results share memory."""
    runner = GraphRunner(SharedScratchStep(), (2, 4), 2, torch.device("cpu"), EagerBackend(), warmup=0)
    runner.capture_all(["double"])
    runner.prepare(0, host_arrays(), 4, 4)
    first = runner.replay(0, 4, "double")
    want = first["out"].clone()
    other = host_arrays()
    other["host_ids"] += 100
    runner.prepare(1, other, 2, 2)
    second = runner.replay(1, 2, "double")
    assert torch.equal(first["out"], want)
    assert torch.equal(second["out"], want[:2] + 200)
    assert first["out"].data_ptr() == runner.sets[0].outputs["out"].data_ptr()  # the set's own static outputs


def test_graph_runner_checks_the_declared_outputs():
    class Undeclared(ToyStep):
        def run(self, inputs, variant):
            return {**super().run(inputs, variant), "extra": inputs["ids"]}

    runner = GraphRunner(Undeclared(), (2,), 1, torch.device("cpu"), EagerBackend())
    with pytest.raises(ValueError, match="extra"):
        runner.capture(0, 2, "double")


def test_graph_runner_validates_sizes():
    with pytest.raises(ValueError):
        GraphRunner(ToyStep(), (4, 2), 2, torch.device("cpu"), EagerBackend())
    with pytest.raises(ValueError):
        GraphRunner(ToyStep(), (1, 2), 0, torch.device("cpu"), EagerBackend())


# -- the engine's decode step ---------------------------------------------------------------------------
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, MAX_BLOCKS = 4, 48, 8, 8
PROMPT_LENS = (5, 9, 2, 7, 4)
REQUEST_SLOTS = (0, 2, 5, 6, 3)  # token-buffer rows: not contiguous, not in row order


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
    token_buffer[list(REQUEST_SLOTS)] = first
    return caches, token_buffer, tables


def write_decode_rows(slot: HostSlot, tables: np.ndarray, n: int, step: int, temps: list[float], top_k: int) -> StepMeta:
    """What the planner writes for a decode-only step of the first ``n`` requests."""
    pos = np.array([PROMPT_LENS[i] + step for i in range(n)])
    slot.decode_token_slots[:n] = REQUEST_SLOTS[:n]
    slot.positions[:n] = pos
    slot.slot_mapping[:n] = tables[np.arange(n), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    slot.decode_block_tables[:n] = tables[:n]
    slot.decode_context_lens[:n] = pos + 1
    slot.logits_indices[:n] = np.arange(n)
    slot.sample_token_slots[:n] = REQUEST_SLOTS[:n]
    slot.sample_temperature[:n] = temps[:n]
    slot.sample_top_k[:n] = top_k
    slot.sample_top_p[:n], slot.sample_min_p[:n] = 1.0, 0.0
    slot.sample_seed[:n] = np.arange(n) * 7 + 1
    slot.sample_step[:n] = step
    width = int((pos // BLOCK_SIZE + 1).max())
    greedy = all(t == 0 for t in temps[:n])
    return StepMeta(step, slot, n, n, width, [], n, int(pos.sum()) + n, greedy, top_k > 0 and not greedy,
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
    slots = [HostSlot.allocate(i, 16, MAX_SEQS, MAX_BLOCKS, pinned=False) for i in range(2)]
    try:
        for step_index, n in enumerate([5, 5, 3, 4, 1]):  # the batch shrinks and grows within buckets
            slot = slots[step_index % 2]
            meta = write_decode_rows(slot, tables, n, step_index, temps, top_k)
            chosen = SamplingVariant.for_step(meta)
            assert chosen is (variant if any(temps[:n]) else SamplingVariant.GREEDY)
            with torch.inference_mode():
                want, want_finite, _ = eager._compute(meta, eager._copy_in(meta))
                bucket = runner.bucket_for(n)
                runner.capture(slot.index, bucket, chosen, lazy=True)  # on first use: resets the set to padding
                runner.prepare(slot.index, DecodeGraphStep.host_arrays(slot), n, bucket)
                out = runner.replay(slot.index, bucket, chosen)
            assert out["token_ids"][:n].tolist() == want.tolist(), step_index
            assert out["finite"][:n].all() and want_finite.all()
            assert np.all(slot.decode_block_tables[n:bucket] == DUMMY_BLOCK)
            assert np.all(slot.decode_token_slots[n:bucket] == step.dummy_token_row)
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

    def elapsed_time(self, other) -> float:
        return (other.time - self.time) * 1e3


@pytest.fixture
def cuda_host_shim(monkeypatch):
    """Build ``CudaExecutor`` on the CPU: streams and events are no-ops, memory is not pinned, graphs run
    through ``EagerBackend`` and attention through the torch reference. Its planning, padding, graph
    choice, lazy capture, copies and bookkeeping then run for real, in program order (so this says nothing
    about stream ordering, which ``test_cuda_path`` checks on a GPU). Returns the executor's settings:
    empty means the plain CPU executor."""
    from asyncbatch.executors import cuda_executor, torch_executor
    from asyncbatch.model import paged_attention

    for name, fake in (("Stream", _NoStream), ("Event", _NoEvent), ("stream", lambda s: contextlib.nullcontext()),
                       ("synchronize", lambda *args, **kwargs: None)):
        monkeypatch.setattr(torch.cuda, name, fake)
    reference = types.SimpleNamespace(paged_attention=paged_attention.reference_attention)
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

    def build(model, kv_caches, max_num_seqs, device):
        if not settings:
            return cpu_executor(model, kv_caches, max_num_seqs, device)
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
        with LLM(str(path), device="cpu", max_num_seqs=6, max_num_batched_tokens=32, block_size=4,
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
