"""vLLM's priority scheduling (``scheduling_policy="priority"``, ``SamplingParams.priority``, ``generate(priority=)``):
admission by (priority, arrival), the lowest priority preempted first; refused where the policy is FCFS."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from asyncbatch import SamplingParams, SimConfig
from asyncbatch.config import EngineConfig
from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.preemption import enqueue
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.frontend.input_processor import with_priority

FAST_SIM = SimConfig(step_fixed_ms=0.2, output_len_distribution="fixed", output_len_max=100_000)


def drive(sched: Scheduler, requests: list[Request], later: tuple[Request, ...] = ()) -> tuple[list[str], list[str]]:
    """Run the scheduler to the end as a synchronous engine would (``later`` arrive after the first step): the ids
    in the order they were first admitted, and every preemption's victim."""
    admitted: list[str] = []
    preempted: list[str] = []
    for step in range(200):
        if step == 1:
            for r in later:
                sched.add(r)
        plan = sched.schedule()
        if plan is None:
            break
        admitted += [row.request.request_id for row in plan.prefill
                     if row.start == 0 and row.request.request_id not in admitted]
        preempted += [r.request_id for r in plan.preempted]
        sched.release_drained(plan)
        n = plan.num_sampled
        sched.apply(plan, np.full(n, 9, dtype=np.int64), np.ones(n, dtype=bool))
        sched.check_integrity()
    assert all(r.finished for r in (*requests, *later))
    return admitted, preempted


def request(name: str, seq: int, priority: int, prompt_len: int = 3, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    return Request(name, seq, list(range(1, prompt_len + 1)), params, seq, 0.0)


@pytest.mark.parametrize("by_priority", [False, True], ids=["fcfs", "priority"])
def test_admission_follows_priority_then_arrival(by_priority):
    sched = Scheduler(BlockManager(num_blocks=64, block_size=4, max_num_seqs=1, max_blocks_per_seq=4), 16,
                      priority=by_priority)
    requests = [request(name, seq, p) for seq, (name, p) in enumerate([("late", 3), ("first", 0), ("tie-a", 1),
                                                                        ("tie-b", 1), ("last", 9)])]
    for r in requests:
        sched.add(r)
    admitted, _ = drive(sched, requests)
    want = ["first", "tie-a", "tie-b", "late", "last"] if by_priority else [r.request_id for r in requests]
    assert admitted == want


@pytest.mark.parametrize("by_priority", [False, True], ids=["fcfs", "priority"])
def test_kv_pressure_preempts_the_lowest_priority(by_priority):
    """Two requests that cannot both finish in 4 blocks, the urgent one arriving (and admitted) a step after
    the other: FCFS preempts the newer one, the priority policy the one of larger value though it came first;
    each preempted request is recomputed and finishes."""
    sched = Scheduler(BlockManager(num_blocks=5, block_size=2, max_num_seqs=2, max_blocks_per_seq=4), 16,
                      priority=by_priority)
    background = request("background", 0, priority=5)
    urgent = request("urgent", 1, priority=0)
    sched.add(background)
    admitted, preempted = drive(sched, [background], later=(urgent,))
    assert admitted[:2] == ["background", "urgent"]
    assert preempted, "the workload must run out of blocks"
    assert set(preempted) == ({"background"} if by_priority else {"urgent"})


@pytest.mark.parametrize("by_priority", [False, True], ids=["fcfs", "priority"])
def test_the_queue_orders_by_priority_then_arrival(by_priority):
    """``enqueue`` as ``Scheduler.add`` and a preemption use it: a preempted request (an earlier arrival) goes
    back before the later arrivals of its priority, and after every better one."""
    waiting: deque[Request] = deque()
    for r in (request("mid-2", 2, 3), request("high", 3, 1), request("mid-1", 1, 3), request("low", 4, 8)):
        enqueue(waiting, r, by_priority)
    want = ["high", "mid-1", "mid-2", "low"] if by_priority else ["mid-1", "mid-2", "high", "low"]
    assert [r.request_id for r in waiting] == want


def test_the_engine_runs_requests_by_priority(make_llm):
    llm = make_llm("smollm2-135m", device="sim", sim=FAST_SIM, max_num_seqs=1, scheduling_policy="priority",
                   skip_tokenizer_init=True, engine_process=False)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = llm.generate([[5, 6], [7, 8], [9, 10], [11, 12]], params, use_tqdm=False, priority=[3, 0, 2, 1])
    started = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == [1, 3, 2, 0]
    assert all(len(o.token_ids) == 3 for o in outs)
    assert params.priority == 0  # the shared params were copied, not changed


def test_priority_is_refused_where_the_policy_is_fcfs(make_llm):
    llm = make_llm("smollm2-135m", device="sim", sim=FAST_SIM, skip_tokenizer_init=True, engine_process=False)
    with pytest.raises(ValueError, match=r"SamplingParams.priority must be 0 unless the engine's scheduling_policy "
                                         r"is 'priority' \(it is 'fcfs'\), got 2"):
        llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 2])
    assert llm.num_requests() == (0, 0)  # the first prompt was not queued either
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False, priority=[0])[0]
    assert len(out.token_ids) == 2  # priority 0 is every request's under FCFS


def test_bad_priorities_name_the_field():
    with pytest.raises(ValueError, match=r"priority must be in \[-2\*\*31, 2\*\*31\], got 4294967296"):
        SamplingParams(priority=2**32)
    with pytest.raises(TypeError, match="priority"):
        SamplingParams(priority=1.5)
    with pytest.raises(ValueError, match="priority is given twice, 1 in generate"):
        with_priority(SamplingParams(priority=2), 1)
    assert with_priority(SamplingParams(priority=2), 2).priority == 2
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")
