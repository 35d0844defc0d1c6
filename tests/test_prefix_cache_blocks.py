"""Prefix caching in the block manager and the scheduler, without a model.

The property tests drive the real scheduler, metadata writer and staging
buffers with random arrivals of prompts that share prefixes (block-aligned
or not, some equal to a whole earlier prompt), aborts and stop strings from
the frontend, caches small enough to preempt and evict, and a lag of 0-2
steps between launch and apply. A shadow device (``kv_shadow``) executes every
plan and checks that each row reads only its own prefix, so a block freed
while referenced, a cached block whose content does not match its key, or one
read in the step that writes it fails at once. ``check_integrity`` (hash
table, reference counts, the free/evictable/held partition) runs after every
step, and every request's tokens must equal those of the same run with
caching off.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np
import pytest
from engine_checks import wait_all_ended
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_shadow import ShadowDevice

from asyncbatch.engine import prefix_sharing
from asyncbatch.engine.block_manager import BlockManager, IntegrityError, blocks_for_tokens
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.prefix_cache import ROOT, PrefixCache, chain_keys, salted_root
from asyncbatch.engine.request import Request, RequestStatus
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.sampling_params import SamplingParams

MAX_PROMPT, MAX_OUTPUT = 48, 20


@dataclass(frozen=True)
class Spec:
    arrival: int
    prompt: tuple[int, ...]
    max_tokens: int
    stop_after: int | None  # the frontend ends the request (a stop string) after this many outputs
    abort_at: int | None


def make_prompts(rng: random.Random, n: int, bases: int) -> list[tuple[int, ...]]:
    """Prompts built from a few shared bases: cut anywhere (aligned or not), with or without a suffix."""
    base = [[rng.randrange(100, 400) for _ in range(MAX_PROMPT)] for _ in range(bases)]
    prompts = []
    for _ in range(n):
        cut = rng.randint(1, MAX_PROMPT)
        suffix = [rng.randrange(100, 400) for _ in range(rng.choice([0, 0, 1, 3, 9]))]
        prompts.append(tuple((base[rng.randrange(bases)][:cut] + suffix)[:MAX_PROMPT]))
    return prompts


def random_specs(rng: random.Random, n: int, arrivals: int, bases: int) -> list[Spec]:
    prompts = make_prompts(rng, n, bases)
    return [Spec(rng.randrange(arrivals), p, rng.randint(1, MAX_OUTPUT),
                 rng.choice([None, None, rng.randint(1, MAX_OUTPUT)]),
                 rng.choice([None] * 5 + [rng.randrange(arrivals + 20)])) for p in prompts]


class Rig:
    """The planner (scheduler, writer, staging) over a shadow device, as the engine core drives them."""

    def __init__(self, specs: list[Spec], block_size: int, num_blocks: int, max_seqs: int, budget: int, lag: int,
                 caching: bool) -> None:
        max_blocks = blocks_for_tokens(MAX_PROMPT + MAX_OUTPUT, block_size)
        self.blocks = BlockManager(num_blocks, block_size, max_seqs, max_blocks, prefix_caching=caching)
        self.sched = Scheduler(self.blocks, budget)
        self.writer = StepMetadataWriter(self.sched.rows, self.blocks)
        self.staging = StagingPair(budget, max_seqs, max_blocks, pinned=False)
        self.device = ShadowDevice(max_seqs, block_size)
        self.lag = lag
        capacity = (num_blocks - 1) * block_size
        self.specs = [s for s in sorted(specs, key=lambda s: s.arrival)
                      if len(s.prompt) + s.max_tokens <= capacity]  # refused at submission otherwise
        self.requests: dict[int, Request] = {}
        self.outputs: dict[int, list[int]] = {}
        self.counts = {"preemptions": 0, "hits": 0, "full_prompt_hits": 0}

    def run(self, max_steps: int = 4000) -> Rig:
        in_flight: deque = deque()
        for step in range(max_steps):
            for seq, spec in enumerate(self.specs):
                if spec.arrival == step:
                    request = Request(str(seq), seq, list(spec.prompt), SamplingParams(max_tokens=spec.max_tokens),
                                      seq, 0.0)
                    self.requests[seq] = request
                    self.outputs[seq] = []
                    self.sched.add(request)
                if spec.abort_at == step and seq in self.requests:
                    self.sched.finish(self.requests[seq], "abort")
            plan = self.sched.schedule()
            if plan is not None:
                self.counts["preemptions"] += len(plan.preempted)
                bs = self.blocks.block_size
                for row in plan.prefill:
                    assert row.num_cached == (row.start if row.first else 0) and row.num_cached % bs == 0
                    self.counts["hits"] += row.num_cached > 0
                    # Every block but the last reused: the prompt was (about) entirely cached.
                    self.counts["full_prompt_hits"] += 0 < len(row.request.all_token_ids()) - row.num_cached <= bs
                buffer = self.staging.next_buffer()
                meta = self.writer.write(plan, buffer)
                self.sched.release_drained(plan)
                in_flight.append((plan, self.device.run(plan, meta, buffer)))
                self.sched.settle_released(0.0)  # as the core does while a step runs; 0: one piece a step
            if in_flight and (len(in_flight) > self.lag or plan is None):
                done, tokens = in_flight.popleft()
                applied = self.sched.apply(done, tokens, np.ones(len(tokens), dtype=bool))
                for seq, token in zip(applied.seqs.tolist(), applied.token_ids.tolist()):
                    self.outputs[seq].append(token)
                    stop_after = self.specs[seq].stop_after
                    if stop_after is not None and len(self.outputs[seq]) >= stop_after:
                        self.sched.finish(self.requests[seq], "stop")
            self.sched.check_integrity()
            self.device.check_records(self.blocks)
            if step > 40 and not self.sched.has_work() and not in_flight:
                self.sched.settle_released()  # as the core does before it sleeps
                self.sched.check_integrity()
                break
        assert not self.sched.has_work(), "the scheduler stalled with work left"
        assert all(r.status is RequestStatus.FINISHED and r.num_pending == 0 for r in self.requests.values())
        assert not self.sched._off_row
        assert self.blocks.num_free_blocks == self.blocks.num_usable_blocks, "a block leaked"
        assert not self.blocks.ref.any()
        return self


def run_both(specs: list[Spec], *args: int) -> Rig:
    on = Rig(specs, *args, caching=True).run()
    off = Rig(specs, *args, caching=False).run()
    for seq, spec in enumerate(on.specs):
        a, b = on.outputs.get(seq, []), off.outputs.get(seq, [])
        if spec.abort_at is None:
            assert a == b, f"prefix caching changed request {seq}'s tokens"
        else:  # aborted at a fixed step, which caching reaches with more or fewer tokens done
            assert a[:len(b)] == b[:len(a)], f"prefix caching changed request {seq}'s tokens"
    assert off.blocks.prefix is None and on.blocks.prefix is not None
    return on


@st.composite
def workloads(draw) -> list[Spec]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    return random_specs(rng, draw(st.integers(1, 24)), draw(st.integers(1, 30)), draw(st.integers(1, 3)))


@settings(max_examples=120, deadline=None)
@given(specs=workloads(), block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(8, 90),
       max_seqs=st.integers(1, 8), extra_budget=st.integers(0, 40), lag=st.sampled_from([0, 1, 2]))
def test_sharing_never_frees_a_held_block_leaks_one_or_serves_wrong_content(specs, block_size, num_blocks, max_seqs,
                                                                             extra_budget, lag):
    run_both(specs, block_size, num_blocks, max_seqs, max_seqs + extra_budget, lag)


@pytest.mark.slow
def test_long_random_runs_take_every_path():
    """Larger seeded workloads, check_integrity after every step; hits, preemptions and evictions must happen."""
    totals = {"preemptions": 0, "hits": 0, "full_prompt_hits": 0, "evictions": 0, "cached_tokens": 0}
    for seed, (block_size, num_blocks, max_seqs, budget, lag) in enumerate(
            [(4, 40, 8, 24, 1), (16, 14, 16, 64, 1), (1, 120, 6, 20, 0), (2, 50, 12, 40, 2), (4, 30, 32, 48, 1)]):
        rig = run_both(random_specs(random.Random(seed), 160, 120, 3), block_size, num_blocks, max_seqs, budget, lag)
        stats = rig.sched.prefix_cache_stats()
        for key in ("preemptions", "hits", "full_prompt_hits"):
            totals[key] += rig.counts[key]
        totals["evictions"] += stats["evictions"]
        totals["cached_tokens"] += stats["cached_tokens"]
        assert rig.device.reads > 0
    assert all(totals.values()), totals


# -- single behaviours -----------------------------------------------------------------------------------------
def rig(block_size: int = 4, num_blocks: int = 40, max_seqs: int = 4, budget: int = 64) -> Rig:
    return Rig([], block_size, num_blocks, max_seqs, budget, 0, caching=True)


def admit(r: Rig, *prompts: list[int], max_tokens: int = 2) -> list:
    """Submit ``prompts`` at once and plan one step; returns its prefill rows (device-checked)."""
    base = len(r.requests)
    for i, prompt in enumerate(prompts):
        request = Request(str(base + i), base + i, list(prompt), SamplingParams(max_tokens=max_tokens), 0, 0.0)
        r.requests[base + i] = request
        r.sched.add(request)
    return step(r).prefill


def step(r: Rig):
    """Plan, write, run on the shadow device and apply one step (no lag)."""
    plan = r.sched.schedule()
    meta = r.writer.write(plan, r.staging.next_buffer())
    r.sched.release_drained(plan)
    tokens = r.device.run(plan, meta, meta.staging)
    r.sched.settle_released(0.0)  # as the core does while a step runs; 0: one piece a step
    applied = r.sched.apply(plan, tokens, np.ones(plan.num_sampled, dtype=bool))
    for seq, token in zip(applied.seqs.tolist(), applied.token_ids.tolist()):
        r.outputs.setdefault(seq, []).append(token)
    if not r.sched.has_work():
        r.sched.settle_released()  # as the core does before it sleeps
    r.sched.check_integrity()
    r.device.check_records(r.blocks)
    return plan


def finish_all(r: Rig) -> None:
    while r.sched.has_work():
        step(r)


def test_reuse_is_block_granular_and_keeps_the_last_token_computed():
    r = rig()
    base = list(range(100, 118))  # 18 tokens: 4 full blocks of 4
    admit(r, base)
    finish_all(r)
    rows = admit(r, base[:10] + [1, 2], base, base[:16])
    assert [(x.start, x.num_cached, x.num_tokens) for x in rows] == [
        (8, 8, 4),  # 10 shared tokens: 2 whole blocks reused
        (16, 16, 2),  # the same prompt: every full block
        (12, 12, 4),  # a prompt that is entirely cached: its last block is computed again
    ]
    stats = r.sched.prefix_cache_stats()
    assert stats["cached_tokens"] == 36 and stats["prompt_tokens"] == 18 + 12 + 18 + 16
    finish_all(r)


def chunks(rows: list) -> list[tuple[str, int, int]]:
    return [(x.request.request_id, x.start, x.num_cached) for x in rows]


def test_blocks_of_a_plan_are_offered_from_the_next_plan_on_and_a_sharer_waits_for_them():
    r = rig()
    prompt = list(range(200, 212))  # 3 full blocks of 4
    # The copy would reuse blocks the first computes in this very step, which are not offered to readers of the
    # same step: it waits a step at the head of the queue, and the unrelated prompt behind it goes first.
    assert chunks(admit(r, prompt, prompt, list(range(300, 305)))) == [("0", 0, 0), ("2", 0, 0)]
    assert [x.request_id for x in r.sched.waiting] == ["1"]
    assert chunks(step(r).prefill) == [("1", 8, 8)]  # every block before its last token reused
    assert r.sched.prefix_cache_stats()["deferred_admissions"] == 1
    finish_all(r)
    assert r.sched.prefix_cache_stats()["cached_blocks"] == 4  # the copy's last block was not registered twice


def test_waiting_sharers_keep_the_rows_they_will_need():
    r = rig(max_seqs=3)
    prompt = list(range(600, 612))
    # Two copies wait for the first's blocks; one row is left, which they will need: the unrelated prompt behind
    # them waits too, and the copies are admitted first in the next plan.
    assert chunks(admit(r, prompt, prompt, prompt, list(range(700, 705)))) == [("0", 0, 0)]
    assert [x.request_id for x in r.sched.waiting] == ["1", "2", "3"]
    assert r.sched.prefix_cache_stats()["deferred_admissions"] == 2
    finish_all(r)


def test_a_sharer_waits_while_a_running_prefill_computes_the_blocks_it_would_reuse():
    r = rig(budget=12)
    long_prompt = list(range(400, 420))  # 5 blocks, prefilled 12 tokens a step
    assert chunks(admit(r, long_prompt)) == [("0", 0, 0)]
    # Blocks 0-2 are cached; the running prefill computes blocks 3-4 in the next plan, and the sharer would reuse
    # block 3: it waits although the budget has room for a chunk of it.
    assert chunks(admit(r, long_prompt[:16] + [1, 2, 3])) == [("0", 12, 0)]
    assert chunks(step(r).prefill) == [("1", 16, 16)]
    assert r.sched.prefix_cache_stats()["deferred_admissions"] == 1
    finish_all(r)


def test_no_wait_where_nothing_more_would_be_reused():
    r = rig()
    prompt = list(range(500, 512))
    # A prompt of one block reuses nothing (the block of its last token is always computed), and a request that
    # scores its prompt never reuses: neither waits for the first. One more token, and the copy would reuse.
    scoring = Request("2", 2, list(prompt), SamplingParams(max_tokens=2, prompt_logprobs=0), 0, 0.0)
    for request in (Request("0", 0, list(prompt), SamplingParams(max_tokens=2), 0, 0.0),
                    Request("1", 1, prompt[:4], SamplingParams(max_tokens=2), 0, 0.0), scoring,
                    Request("3", 3, prompt[:5], SamplingParams(max_tokens=2), 0, 0.0)):
        r.requests[request.arrival_seq] = request
        r.sched.add(request)
    assert chunks(step(r).prefill) == [("0", 0, 0), ("1", 0, 0), ("2", 0, 0)]
    assert r.sched.prefix_cache_stats()["deferred_admissions"] == 1
    assert chunks(step(r).prefill) == [("3", 4, 4)]
    finish_all(r)


def test_outputs_fill_cached_blocks_once_known():
    r = rig()
    prompt = list(range(300, 306))  # 6 tokens; 6 outputs fill positions 6..11 (the last one is never input)
    admit(r, prompt, max_tokens=7)
    finish_all(r)
    # Positions 0..11 hold known tokens whose KV was computed: 3 full blocks.
    assert r.sched.prefix_cache_stats()["cached_blocks"] == 3
    rows = admit(r, prompt + r.outputs[0] + [5])
    assert rows[0].num_cached == 12
    finish_all(r)


def test_an_output_still_in_flight_is_not_cached():
    """Overlap: the plan that schedules a request's last token releases it before that token is known."""
    r = Rig([Spec(0, tuple(range(400, 404)), 5, None, None)], 4, 40, 2, 16, lag=1, caching=True).run()
    # Positions 0..7 are computed (prompt and 4 decode inputs); at the drained release only 3 outputs were
    # back, so position 7's token was unknown and its block is not cached.
    assert r.sched.prefix_cache_stats()["cached_blocks"] == 1


def _step_without_settling(r: Rig):
    """One step as ``step`` runs it, but with no release slice: finished requests stay parked. Returns the plan."""
    plan = r.sched.schedule()
    meta = r.writer.write(plan, r.staging.next_buffer())
    r.sched.release_drained(plan)
    tokens = r.device.run(plan, meta, meta.staging)
    applied = r.sched.apply(plan, tokens, np.ones(plan.num_sampled, dtype=bool))
    for seq, token in zip(applied.seqs.tolist(), applied.token_ids.tolist()):
        r.outputs.setdefault(seq, []).append(token)
    r.sched.check_integrity()
    return plan


def _run_without_settling(r: Rig) -> None:
    while r.sched.has_work():
        _step_without_settling(r)


def _arrive(r: Rig, prompt: list[int], max_tokens: int = 2):
    """Submit one request and run one step; returns its plan."""
    seq = len(r.requests)
    r.requests[seq] = request = Request(str(seq), seq, list(prompt), SamplingParams(max_tokens=max_tokens), 0, 0.0)
    r.sched.add(request)
    return _step_without_settling(r)


def test_released_blocks_stay_parked_until_settled_and_what_arrives_settles_them_first(monkeypatch):
    """A finished request's row is free at once; its blocks are registered and freed by ``settle_released`` in
    pieces, within its budget and while its ``stop`` says the awaited step still runs (asked before every piece,
    the first included), or all at once when a plan might need them."""
    r = rig(block_size=4, num_blocks=64, max_seqs=4, budget=64)
    prompts = [list(range(500 + 20 * i, 506 + 20 * i)) for i in range(3)]
    admit(r, *prompts, max_tokens=7)  # 6 + 6 known tokens each: 3 full blocks
    _run_without_settling(r)
    assert (r.sched.rows.seq == -1).all() and r.sched.prefix.num_pending == 3
    assert r.blocks.num_parked_blocks == 9 and r.blocks.num_free_blocks == r.blocks.num_usable_blocks - 9
    assert r.blocks.prefix.num_cached == 3  # the prompts' first blocks, registered when their prefill was planned
    asked: list[int] = []

    def step_done_after(n: int):  # the core's stop: the step it waits for is done at the n-th question
        def stop() -> bool:
            asked.append(r.sched.prefix.num_pending)
            return len(asked) >= n
        return stop

    assert r.sched.settle_released(1.0, stop=step_done_after(1)) == 3  # done already: nothing settled
    assert asked == [3] and r.blocks.num_parked_blocks == 9 and r.blocks.prefix.num_cached == 3
    asked.clear()
    assert r.sched.settle_released(1.0, stop=step_done_after(2)) == 2  # one piece (a whole release here)
    assert asked == [3, 2]  # asked before each piece, and it stopped at the first yes
    r.sched.check_integrity()
    assert r.blocks.num_parked_blocks == 6 and r.blocks.prefix.num_cached == 5
    assert r.sched.settle_released(0.0, stop=lambda: False) == 1  # the step still runs, the budget is spent
    r.sched.check_integrity()
    assert r.blocks.num_parked_blocks == 3 and r.blocks.prefix.num_cached == 7
    # Pieces smaller than a release: its blocks are cached piece by piece and freed with the last one.
    monkeypatch.setattr(prefix_sharing, "SETTLE_PIECE_BLOCKS", 1)
    assert r.sched.settle_released(0.0, stop=lambda: False) == 1
    r.sched.check_integrity()
    assert r.blocks.num_parked_blocks == 3 and r.blocks.prefix.num_cached == 8
    # A request that waits settles the rest before it is admitted, so it reuses the outputs' blocks.
    rows = admit(r, prompts[2] + r.outputs[2] + [9])
    assert rows[0].num_cached == 12 and r.sched.prefix.num_pending == 0
    finish_all(r)
    assert r.blocks.num_free_blocks == r.blocks.num_usable_blocks


def test_a_waiting_request_settles_only_the_releases_it_may_reuse():
    """Before a plan, the parked releases whose registered blocks a waiting request's prompt passes through (its
    next blocks may be their outputs) are settled and reused; the others stay parked for the release slices; a
    release with no registered block is settled with all the rest (any prompt may start with its outputs)."""
    r = rig(block_size=4, num_blocks=64, max_seqs=4, budget=64)
    prompts = [list(range(500 + 20 * i, 506 + 20 * i)) for i in range(3)]
    admit(r, *prompts, max_tokens=7)
    _run_without_settling(r)
    assert r.sched.prefix.num_pending == 3
    _arrive(r, list(range(900, 906)))  # shares nothing with them
    assert r.sched.prefix.num_pending == 3
    _run_without_settling(r)
    plan = _arrive(r, prompts[1] + r.outputs[1] + [9])  # the second one's next turn
    assert r.sched.prefix.num_pending == 2  # that release alone, and its outputs reused
    assert plan.prefill[0].num_cached == 12
    _run_without_settling(r)
    r.sched.settle_released()
    r.requests[99] = short = Request("short", 99, [700, 701, 702], SamplingParams(max_tokens=7), 0, 0.0)
    r.sched.add(short)
    _run_without_settling(r)
    assert r.sched.prefix.num_pending == 1  # parked with nothing registered: its prompt fills no block
    _arrive(r, list(range(950, 956)))
    assert r.sched.prefix.num_pending == 0
    _run_without_settling(r)
    r.sched.settle_released()
    assert r.blocks.num_free_blocks == r.blocks.num_usable_blocks


def test_parked_blocks_that_stop_the_queue_are_settled_in_the_same_plan():
    """A waiting request that reuses evictable blocks takes more free blocks than the plan's estimate counts; if
    parked releases (which it cannot reuse) hold the rest, they are settled and it is admitted in the same plan,
    never left waiting with nothing running."""
    r = rig(block_size=4, num_blocks=22, max_seqs=4, budget=8)  # 21 usable blocks
    p = list(range(300, 320))  # 5 full blocks, cached and evictable once it ends
    _arrive(r, p, max_tokens=1)
    _run_without_settling(r)
    assert r.blocks.num_unused_blocks == 16 and r.blocks.num_free_blocks == 21
    # Two 32-token requests (16 prompt tokens + 16 outputs each): 16 blocks, parked when they end.
    admit(r, *(list(range(600 + 40 * i, 616 + 40 * i)) for i in range(2)), max_tokens=16)
    _run_without_settling(r)
    assert r.sched.prefix.num_pending == 2 and r.blocks.num_free_blocks == 5  # P's evictable blocks
    plan = _arrive(r, p + [1, 2, 3, 4])  # 5 blocks reused + 1 fresh > 5 free; it reuses nothing parked
    assert plan is not None and plan.prefill[0].num_cached == 20
    assert r.sched.prefix.num_pending == 0
    _run_without_settling(r)
    r.sched.settle_released()
    assert r.blocks.num_free_blocks == r.blocks.num_usable_blocks


def test_parked_blocks_are_settled_before_anyone_is_preempted():
    """A decode row that needs a block while the free ones are parked takes a settled one, not a victim."""
    r = rig(block_size=2, num_blocks=12, max_seqs=2, budget=16)  # 11 usable blocks
    admit(r, [1, 2, 3, 4, 5], max_tokens=6)
    admit(r, [7, 8, 9], max_tokens=12)  # the long one: grows while the first one's blocks are parked
    preempted = []
    while r.sched.has_work():
        plan = r.sched.schedule()
        preempted += plan.preempted
        meta = r.writer.write(plan, r.staging.next_buffer())
        r.sched.release_drained(plan)
        tokens = r.device.run(plan, meta, meta.staging)
        r.sched.apply(plan, tokens, np.ones(plan.num_sampled, dtype=bool))
        r.sched.check_integrity()
        r.device.check_records(r.blocks)
    assert not preempted
    r.sched.settle_released()
    assert r.blocks.num_free_blocks == r.blocks.num_usable_blocks


def test_preempted_request_recomputes_from_what_is_still_cached():
    r = rig(block_size=2, num_blocks=9, max_seqs=2, budget=16)  # 8 usable blocks = 16 tokens
    a = admit(r, [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], max_tokens=6)
    assert len(a) == 2
    preempted = []
    hits = []
    while r.sched.has_work():
        plan = step(r)
        preempted += plan.preempted
        hits += [x.num_cached for x in plan.prefill if x.first and x.request.num_preemptions]
    assert preempted, "the small cache should force a preemption"
    assert hits and all(h > 0 for h in hits), hits
    assert r.blocks.num_free_blocks == r.blocks.num_usable_blocks


def test_eviction_takes_free_blocks_first_then_least_recently_released_tails_first():
    blocks = BlockManager(8, 2, 2, 8, prefix_caching=True)
    keys, contents = [], []
    chain_keys([1, 2, 3, 4], 2, keys, contents)
    assert contents == [(1, 2), (3, 4)]
    blocks.allocate(0, 4)  # blocks 1, 2
    blocks.register(0, keys, contents, 2)
    blocks.allocate(1, 2)  # block 3
    blocks.free(0)
    blocks.free(1)
    assert blocks.num_free_blocks == 7 and blocks.prefix.num_evictable == 2
    blocks.allocate(0, 10)  # 5 blocks: the 5 free ones first (3 among them), no eviction
    assert blocks.prefix.num_cached == 2 and blocks.prefix.stats.evictions == 0
    blocks.allocate(1, 2)  # one more: evict the cached tail (block 2) before its parent (block 1)
    assert blocks.block_table[1, 0] == 2 and blocks.prefix.num_cached == 1
    assert blocks.prefix.stats.evictions == 1
    blocks.check_integrity(np.array([0, 1]))


def test_a_hash_collision_costs_a_hit_never_wrong_tokens():
    cache = PrefixCache(8, 2)
    key = 12345
    first: list[int] = []
    cache.register_chains([(first, [1], [key], [(1, 2)], 1, ROOT)])
    assert first == [1] and cache.cached[1]  # serial 1
    collided: list[int] = []  # same key, other content: not registered, and the chain ends there
    cache.register_chains([(collided, [2, 3], [key, 99], [(3, 4), (5, 6)], 2, ROOT)])
    assert collided == [] and not cache.cached[2] and not cache.cached[3] and cache.num_cached == 1
    assert cache.match([key], [(3, 4)], 1) == []  # the key matches, the tokens do not
    assert cache.match([key], [(1, 2)], 1)[0].block == 1
    other_prefix = [7]  # same tokens after another prefix (serial 7, key 5): not registered
    cache.register_chains([(other_prefix, [0, 4], [5, key], [(9, 9), (1, 2)], 2, ROOT)])
    assert other_prefix == [7] and not cache.cached[4]
    again: list[int] = []  # the same content after the same prefix: the record names it, the block stays uncached
    cache.register_chains([(again, [5], [key], [(1, 2)], 1, ROOT)])
    assert again == [1] and not cache.cached[5] and cache.num_cached == 1


def test_a_cache_salt_gives_a_chain_of_its_own():
    """``cache_salt``: the same tokens under another salt (or none) have other keys and are never verified against
    each other's records, even where a key were forced equal (the first block's root serial differs); under the
    same salt they hit. The cache's own check accepts the salted records."""
    cache = PrefixCache(8, 2)
    tokens = [1, 2, 3, 4]
    roots = {salt: salted_root(salt) for salt in (None, "tenant-a", "tenant-b")}
    assert roots[None] == ROOT and len({r for r in roots.values()}) == 3
    assert all(serial < 0 for _, serial in (roots["tenant-a"], roots["tenant-b"]))
    chains = {}
    for i, (salt, (root_key, root_serial)) in enumerate(roots.items()):
        keys, contents = [], []
        chain_keys(tokens, 2, keys, contents, root_key)
        chains[salt] = (keys, contents)
        assert cache.match(keys, contents, 2, root_serial) == []  # nobody else's blocks
        chain: list[int] = []
        cache.register_chains([(chain, [1 + 2 * i, 2 + 2 * i], keys, contents, 2, (root_key, root_serial))])
        assert [rec.block for rec in cache.match(keys, contents, 2, root_serial)] == [1 + 2 * i, 2 + 2 * i]
    assert len({tuple(k) for k, _ in chains.values()}) == 3 and cache.num_cached == 6
    keys_a, contents_a = chains["tenant-a"]
    assert cache.match(keys_a, contents_a, 2, roots["tenant-b"][1]) == []  # another root serial: no verification
    cache.check(cache.cached.astype(np.int64), AssertionError)  # every registered block still held


def test_reset_drops_only_unreferenced_blocks():
    r = rig()
    prompt = list(range(500, 509))
    admit(r, prompt, max_tokens=1)
    finish_all(r)
    assert r.sched.prefix_cache_stats()["cached_blocks"] == 2
    assert r.sched.reset_prefix_cache()
    assert r.sched.prefix_cache_stats() == {"enabled": True, "prompt_tokens": 0, "cached_tokens": 0,
                                            "hit_rate": 0.0, "cached_blocks": 0, "evictions": 0,
                                            "deferred_admissions": 0}
    admit(r, prompt, max_tokens=3)  # running: its 2 registered blocks are referenced
    assert not r.sched.reset_prefix_cache()
    assert r.sched.prefix_cache_stats()["cached_blocks"] == 2
    r.sched.check_integrity()
    finish_all(r)
    assert r.blocks.num_free_blocks == r.blocks.num_usable_blocks


def test_check_integrity_sees_broken_counts_and_records():
    r = rig()
    admit(r, list(range(600, 609)), max_tokens=3)
    r.sched.check_integrity()
    block = int(r.blocks.block_table[r.requests[0].token_row, 0])
    r.blocks.ref[block] += 1
    with pytest.raises(IntegrityError, match="reference counts"):
        r.sched.check_integrity()
    r.blocks.ref[block] -= 1
    rec = r.blocks.prefix.record(block)
    rec.tokens = (0,) * len(rec.tokens)
    with pytest.raises(IntegrityError, match="hash of its parent key and tokens"):
        r.sched.check_integrity()


# -- the engine on the simulated device --------------------------------------------------------------------------
def sim_workload(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [list(p) for p in make_prompts(random.Random(5), n, 3)]
    params = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=30, temperature=0.0))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=5 + i % 25, temperature=0.8, seed=i, presence_penalty=0.5))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=30, temperature=0.0, stop=["e", "ab"]))
        else:
            params.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    return prompts, params


@pytest.mark.slow
def test_engine_on_sim_checks_integrity_after_every_step(make_llm):
    """The engine core checks integrity after every launch and every apply; streams abort mid-way."""
    from asyncbatch import SimConfig

    sim = SimConfig(step_fixed_ms=0.1, per_token_us=0.0, per_context_token_ns=0.0, output_len_min=4,
                    output_len_max=40)
    results = {}
    for caching in (True, False):
        llm = make_llm(device="sim", sim=sim, enable_prefix_caching=caching, debug_check_integrity=True,
                       num_kv_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
        prompts, params = sim_workload(160)
        streams = [llm.stream(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts[:6]]
        for i, stream in enumerate(streams):
            for n, _ in enumerate(stream):
                if n == i:
                    stream.close()  # aborts the request, its blocks possibly shared (a stream kept in a list
                    break  # is only suspended by leaving the loop)
        wait_all_ended(llm)
        assert llm.stats()["output_tokens"] < 6 * 30, "the closed streams' requests ran to their end"
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[caching] = ([o.token_ids for o in outs], llm.stats(), llm.prefix_cache_stats())
        llm.check_integrity()
        assert llm.num_free_blocks == llm.num_usable_blocks
    (on, on_stats, cache), (off, off_stats, _) = results[True], results[False]
    assert on == off
    assert cache["hit_rate"] > 0.2 and cache["evictions"] > 0, cache
    assert on_stats["preemptions"] > 0 and off_stats["preemptions"] > 0


def test_an_admission_batch_shares_and_evicts_as_it_decides_and_writes_both_with_its_allocation():
    """What ``Admitter.admit`` does to the blocks of one batch: ``share`` reclaims an evictable block at once (a
    second sharer counts it held, no eviction can take it), ``evict_for_admission`` takes the oldest cached block
    out of the cache at once once the free stack is spoken for; table entries, reference counts and fresh blocks
    (the stack's, then the evicted) land with the batch's ``allocate_admitted``, and a batch left unallocated is an
    integrity error."""
    blocks = BlockManager(7, 2, 3, 4, prefix_caching=True)
    keys, contents = [], []
    chain_keys([1, 2, 3, 4], 2, keys, contents)
    blocks.allocate(0, 4)  # blocks 1, 2, cached, then released: both evictable, 1 the older
    blocks.register(0, keys, contents, 2)
    blocks.free(0)
    blocks.allocate(2, 6)  # blocks 3, 4, 5: block 6 is the free stack's last
    assert blocks.num_unused_blocks == 1 and blocks.prefix.num_evictable == 2
    cached = blocks.prefix.match(keys, contents, 1)  # block 1
    blocks.share(0, cached, [1], num_idle=1)
    assert blocks.ref[1] == 1 and blocks.prefix.num_evictable == 1  # reclaimed now
    blocks.share(1, cached, [1], num_idle=0)  # the second sharer sees it held
    assert blocks.ref[1] == 1 and blocks.block_table[1, 0] == 0  # its count and table entry wait for the batch
    # Row 0's fresh block is the stack's; row 1's needs an eviction: block 2, the only evictable one left.
    blocks.evict_for_admission(1)
    assert blocks.prefix.num_cached == 1 and blocks.prefix.num_evictable == 0
    with pytest.raises(IntegrityError, match="never allocated"):
        blocks.check_integrity(np.array([0, 1, 2]))
    rows, counts, grown, lasts = np.array([0, 1]), np.array([1, 1]), np.array([2, 2]), np.array([0, 1])
    blocks.allocate_admitted(rows, counts, grown, lasts, rows * 4 + grown - 1 - lasts, 2)
    assert blocks.block_table[0, :2].tolist() == [1, 6] and blocks.block_table[1, :2].tolist() == [1, 2]
    assert blocks.ref[[1, 2, 6]].tolist() == [2, 1, 1] and blocks.num_row_blocks[:2].tolist() == [2, 2]
    blocks.check_integrity(np.array([0, 1, 2]))
