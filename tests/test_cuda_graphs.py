"""The ``cuda_graphs`` package on CPU: buckets, padding, static-buffer refill, graph sets and their outputs.

Capture itself needs CUDA (``tests/test_cuda_path.py``); here ``EagerBackend``
stands in for it, so everything around capture runs with plain CPU tensors.
The engine's own decode step and the CUDA executor are in ``test_decode_graph``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

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
