"""The CUDA executor's stream protocol, checked for unordered accesses on the CPU (``stream_order``).

The whole engine runs on the CPU shim of ``test_decode_graph`` with the
happens-before checker in place of streams and events: every access to a
buffer that two timelines share (staging buffers, pinned result buffers, the
graphs' static inputs and outputs) must be ordered by the events, waits and
synchronizations the executor issues, as a GPU would honour them. Two
negative controls take one ordering away each and must be caught. (The staging
fence cannot serve as one: at pipeline depth two, ``wait(N)`` already orders
the host's rewrite of step N's staging after its copies; the fence is what keeps
that true if the depth grows.)
"""

from __future__ import annotations

import re

import pytest
from stream_order import StreamOrderChecker
from test_decode_graph import cuda_host_shim, shim_workload  # noqa: F401 - the fixture is used by name
from tiny_models import save_tiny_model

from asyncbatch import LLM


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("stream-order") / "llama", "LlamaForCausalLM")


def checked_run(path, shim, monkeypatch, overlap: bool, graphs: bool, sabotage=None) -> StreamOrderChecker:
    checker = StreamOrderChecker()
    checker.install(monkeypatch)
    shim.update(enable_cuda_graphs=graphs, cuda_graph_batch_sizes=(2, 4))  # 1-row steps replay padded
    prompts, params = shim_workload()
    with LLM(str(path), device="cpu", dtype="float32", engine_process=False, max_num_seqs=6, max_num_batched_tokens=32, block_size=4,
             overlap=overlap) as llm:
        checker.watch_engine(llm._core, monkeypatch)
        if sabotage is not None:
            sabotage(llm._core.executor)
        checker.enabled = True
        outs = llm.generate(prompts, params, use_tqdm=False)
        checker.enabled = False
    assert all(o.finish_reason == "length" for o in outs)
    return checker


def describe(races) -> str:
    return "\n".join(f"{a.buffer}: {a.what} ({a.timeline}) vs {b.what} ({b.timeline})" for a, b in races[:10])


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_every_shared_access_is_ordered(tiny_path, cuda_host_shim, monkeypatch, overlap, graphs):  # noqa: F811
    checker = checked_run(tiny_path, cuda_host_shim, monkeypatch, overlap, graphs)
    kinds = {re.sub(r"\d+", "N", a.what) for a in checker.accesses}
    assert {"copy_ destination", "metadata writer, staging N", "wait(N) reads _out_host",
            "upload (.to non_blocking)"} <= kinds  # prefill steps upload in both modes
    if graphs:
        assert {"replay set N bucket N", "pad host rows", "pack set N's host block"} <= kinds, kinds
        assert any(a.buffer.endswith("host_block") and not a.write and a.timeline.startswith("stream:")
                   for a in checker.accesses)  # the one copy of the packed inputs reads it on the H2D stream
    timelines = {a.timeline for a in checker.accesses}
    assert sum(t.startswith("stream:") for t in timelines) == (3 if graphs else 2)  # H2D, D2H (+ replays)
    assert len(checker.conflicts()) > 200  # host vs H2D on the staging buffers, D2H vs host on the results, ...
    races = checker.races()
    assert not races, describe(races)


class _Forgetful(list):
    """``_set_free`` that never remembers an event: refills stop waiting for the set's last copy-out."""

    def __getitem__(self, index):
        return None

    def __setitem__(self, index, value):
        pass


def test_checker_catches_a_refill_that_does_not_wait(tiny_path, cuda_host_shim, monkeypatch):  # noqa: F811
    def sabotage(executor):
        executor._set_free = _Forgetful([None, None])

    races = checked_run(tiny_path, cuda_host_shim, monkeypatch, True, True, sabotage).races()
    assert any(a.buffer.startswith("set") for a, _ in races), describe(races)


def test_checker_sees_the_packed_host_block(tiny_path, cuda_host_shim, monkeypatch):  # noqa: F811
    """A set's host block is packed on the host by the launch that refills the set and read by its one copy on
    the H2D stream; what orders the packing after the previous copy out of the block is the host's waits on
    events (the staging fence's, and ``wait`` for the step two back). With no event wait bringing the device's
    clocks to the host, the checker must report the block among the races."""
    import stream_order

    monkeypatch.setattr(stream_order._Event, "synchronize", lambda event: None)
    races = checked_run(tiny_path, cuda_host_shim, monkeypatch, True, True).races()
    assert any(a.buffer.endswith("host_block") for pair in races for a in pair), describe(races)


def test_checker_catches_a_copy_out_that_does_not_wait(tiny_path, cuda_host_shim, monkeypatch):  # noqa: F811
    def sabotage(executor):
        executor.d2h_stream.wait_event = lambda event: None  # D2H no longer waits for the step's end

    races = checked_run(tiny_path, cuda_host_shim, monkeypatch, True, True, sabotage).races()
    assert any(a.buffer.startswith("set") and ".token_ids" in a.buffer for a, _ in races), describe(races)
