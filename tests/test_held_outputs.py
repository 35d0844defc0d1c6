"""A step's outputs reach the frontend after the step two later is launched, in the order they were made.

In overlap mode the planner holds step N's ``StepOutputs`` until it has launched
N+2 (engine/core.py: handing them to the sender thread would cost the planner
the GIL on the device's critical path). What must still hold: every message
goes out, step outputs in step order, and any other message (an abort's end,
a control reply) leaves after the outputs made before it, so the frontend
never sees a request's tokens after it saw it end.
"""

from __future__ import annotations

import threading

import pytest

from asyncbatch import LLM, SamplingParams, SimConfig
from asyncbatch.engine.messages import Finish, StepOutputs


def recording_engine(overlap: bool) -> tuple[LLM, list[tuple[int, object]]]:
    """An in-process sim engine whose core records (newest launched step, message) for every message sent."""
    llm = LLM(device="sim", sim=SimConfig(step_fixed_ms=0.5, output_len_min=8, output_len_max=40), overlap=overlap,
              engine_process=False, max_num_seqs=16, debug_check_integrity=True)
    core = llm._client.core
    log: list[tuple[int, object]] = []
    lock = threading.Lock()
    raw = core._send_now

    def record(message: object) -> None:
        with lock:
            log.append((core.last_launched_step, message))
        raw(message)

    core._send_now = record  # the planner reads it per call; it is idle (no request yet) while this is swapped
    return llm, log


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_outputs_in_step_order_after_the_next_launch_and_before_later_ends(overlap):
    llm, log = recording_engine(overlap)
    try:
        params = SamplingParams(max_tokens=200, temperature=0.8, seed=1, ignore_eos=True)
        streams = [llm.stream(f"request {i}", params) for i in range(12)]
        for stream in streams[::3]:  # the first four read a few deltas and leave: aborts with steps in flight
            for n, _delta in enumerate(stream):
                if n == 2:
                    break
            stream.close()  # the list still holds the generator: closing it is what leaving it would do
        for i, stream in enumerate(streams):
            if i % 3:
                assert sum(len(d.token_ids) for d in stream) == 200
        outs = llm.generate([f"batch {i}" for i in range(8)], SamplingParams(max_tokens=12), use_tqdm=False)
        assert all(o.finished for o in outs)  # nothing held back once the engine went idle
        llm.check_integrity()
    finally:
        llm.close()
    steps = [(launched, m) for launched, m in log if isinstance(m, StepOutputs) and m.step_id >= 0]
    ids = [m.step_id for _, m in steps]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    records = {m.step_id: m.record for _, m in steps}
    if overlap:  # not before N+1's launch, and held until N+2's, wherever that step came next (no idle before it)
        assert all(launched >= m.step_id + 1 for launched, m in steps
                   if m.step_id + 1 in records and not records[m.step_id + 1].after_idle)
        followed = [(launched, m) for launched, m in steps
                    if m.step_id + 2 in records and not records[m.step_id + 2].after_idle]
        held = [m.step_id for launched, m in followed if launched >= m.step_id + 2]
        assert len(held) >= 0.9 * len(followed) > 0.5 * len(steps)
    else:  # synchronous mode sends before planning the next step
        assert all(launched == m.step_id for launched, m in steps)
    aborted: set[int] = set()
    for _, m in log:
        if not isinstance(m, StepOutputs):
            continue
        assert not aborted.intersection(m.seqs.tolist()), "tokens of a request sent after its end"
        aborted.update(s for s, c in zip(m.ended_seqs.tolist(), m.ended_codes.tolist()) if c == Finish.ABORT)
    assert len(aborted) == 4
