"""Property tests of the scheduler and block manager, driven without any device.

A tiny driver plays the engine: it launches plans, completes them ``lag``
steps later (0 = synchronous, 1 = overlap), appends tokens, finishes requests
by length or by a pseudo-EOS, and aborts some at random. After every step it
checks the token budget, the row cap, the layout and ``check_integrity``.
"""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.request import Request, RequestStatus
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.sampling_params import SamplingParams

request_spec = st.tuples(
    st.integers(0, 30),  # arrival step
    st.integers(1, 40),  # prompt length
    st.integers(1, 24),  # max_tokens
    st.one_of(st.none(), st.integers(1, 24)),  # pseudo-EOS after this many outputs
    st.one_of(st.none(), st.integers(0, 40)),  # abort at this step
)


def drive(specs, block_size, num_blocks, max_seqs, budget, lag):
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(blocks, max_seqs, budget)
    capacity = blocks.num_usable_blocks * block_size
    requests = []
    # arrival_seq is submission order, as in the engine.
    for i, (arrival, plen, max_tokens, eos_at, abort_at) in enumerate(sorted(specs, key=lambda s: s[0])):
        if plen + max_tokens > capacity:
            continue  # refused at submission in the real engine
        r = Request(f"r{i}", i, list(range(plen)), SamplingParams(max_tokens=max_tokens), i, 0.0)
        requests.append((arrival, r, eos_at, abort_at))
    in_flight: deque = deque()
    admitted: list[int] = []
    step = 0
    while step < 2000:
        for arrival, r, _, _ in requests:
            if arrival == step:
                sched.add(r)
        for _, r, _, abort_at in requests:
            if abort_at == step and r.status is not RequestStatus.FINISHED and r.arrival_seq in {
                    x.arrival_seq for x in sched.live_requests()}:
                sched.finish(r, "abort")
        plan = sched.schedule()
        if plan is not None:
            assert plan.num_tokens <= budget
            assert len(plan.rows) <= max_seqs
            assert sum(row.num_tokens for row in plan.rows) == plan.num_tokens
            assert all(row.is_decode and row.num_tokens == 1 for row in plan.rows[:plan.num_decode])
            assert not any(row.is_decode for row in plan.rows[plan.num_decode:])
            assert len({id(row.request) for row in plan.rows}) == len(plan.rows)
            for row in plan.rows:
                assert len(row.request.block_ids) * block_size >= row.start + row.num_tokens
                if row.start == 0 and row.request.num_preemptions == 0:
                    admitted.append(row.request.arrival_seq)
            sched.release_drained(plan)
            in_flight.append(plan)
        if in_flight and (len(in_flight) > lag or plan is None):
            done = in_flight.popleft()
            for row in done.rows:
                if not row.samples:
                    continue
                r = row.request
                r.num_pending -= 1
                if r.status is RequestStatus.FINISHED:
                    continue
                r.output_token_ids.append(7)
                eos_at = next(e for _, x, e, _ in requests if x is r)
                if eos_at is not None and len(r.output_token_ids) >= eos_at:
                    sched.finish(r, "stop")
                elif len(r.output_token_ids) >= r.params.max_tokens:
                    sched.finish(r, "length")
        sched.check_integrity()
        step += 1
        if step > 40 and not sched.has_work() and not in_flight:
            break
    return sched, blocks, requests, admitted


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=25), block_size=st.sampled_from([1, 2, 4, 16]),
       num_blocks=st.integers(8, 80), max_seqs=st.integers(1, 8), extra_budget=st.integers(0, 40),
       lag=st.sampled_from([0, 1]))
def test_scheduler_never_violates_budget_or_loses_requests(specs, block_size, num_blocks, max_seqs, extra_budget,
                                                           lag):
    budget = max_seqs + extra_budget
    sched, blocks, requests, admitted = drive(specs, block_size, num_blocks, max_seqs, budget, lag)
    assert not sched.has_work(), "the scheduler stalled with work left"
    for _, r, eos_at, abort_at in requests:
        assert r.status is RequestStatus.FINISHED, f"{r.request_id} was lost"
        assert r.num_pending == 0
        assert len(r.output_token_ids) <= r.params.max_tokens
        if r.finish_reason == "length":
            assert len(r.output_token_ids) == r.params.max_tokens
        if r.finish_reason == "stop":
            assert len(r.output_token_ids) == eos_at
    assert blocks.num_free_blocks == blocks.num_usable_blocks
    assert admitted == sorted(admitted), "first admissions must follow arrival order"


def test_preemption_recomputes_and_frees_once():
    blocks = BlockManager(num_blocks=5, block_size=2)  # 4 usable blocks = 8 tokens
    sched = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=16)
    a = Request("a", 0, [1, 2, 3], SamplingParams(max_tokens=4), 0, 0.0)
    b = Request("b", 1, [4, 5, 6], SamplingParams(max_tokens=4), 1, 0.0)
    sched.add(a)
    sched.add(b)
    seen_preemption = False
    for _ in range(50):
        plan = sched.schedule()
        if plan is None:
            break
        seen_preemption |= bool(plan.preempted)
        sched.release_drained(plan)
        for row in plan.rows:
            if row.samples:
                row.request.num_pending -= 1
                row.request.output_token_ids.append(9)
                if len(row.request.output_token_ids) >= 4:
                    sched.finish(row.request, "length")
        sched.check_integrity()
    assert seen_preemption
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.finished and b.finished
    assert blocks.num_free_blocks == blocks.num_usable_blocks
