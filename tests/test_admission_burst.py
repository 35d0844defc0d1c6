"""Admission bursts: the batched admission (``engine.admission``) against one-at-a-time admission, and a burst
through the engine on ``sim``.

The batched path decides admissions one by one but writes rows, blocks and
staging for all of them at once; its risky parts are the deferred block
allocation (the same block ids as single pops), cache hits that reclaim
evictable blocks, and admissions that evict cached blocks (evicted as each is
decided, handed out with the batch's pop).
The lockstep test drives two schedulers over the same bursts, one with
``Admitter.batch = False`` (each admission applied as it is decided, as the
per-request planner did) and ``Scheduler.batch_release = False`` (drained
requests released one by one), with a KV cache small enough that admissions evict
cached blocks and running requests get preempted, and requires every plan,
block table, free list, cache counter and staging write to agree.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncbatch.config import SimConfig
from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.profiling.gap_report import gap_report
from asyncbatch.sampling_params import SamplingParams

BLOCK, MAX_BLOCKS, ROWS, BUDGET = 16, 8, 32, 512
EOS = 3
VOCAB = 50


class Planner:
    """A scheduler, its metadata writer and staging pair (planner thread only, driven by the test)."""

    def __init__(self, batch: bool, num_blocks: int, min_new_run: int | None = None) -> None:
        self.blocks = BlockManager(num_blocks, BLOCK, ROWS, MAX_BLOCKS, prefix_caching=True)
        self.sched = Scheduler(self.blocks, BUDGET, eos_token_id=EOS)
        self.sched.admitter.batch = batch
        self.sched.batch_release = batch
        if min_new_run is not None:
            self.sched.admitter.min_new_run = min_new_run
        # The runs of new prompts admitted as one (``Admitter._admit_run``), as their lengths.
        self.new_runs: list[int] = []
        admit_run = self.sched.admitter._admit_run

        def counted_runs(run, *rest) -> None:
            self.new_runs.append(len(run.requests))
            admit_run(run, *rest)

        self.sched.admitter._admit_run = counted_runs
        self.writer = StepMetadataWriter(self.sched.rows, self.blocks)
        self.staging = StagingPair(BUDGET, ROWS, MAX_BLOCKS, pinned=False)
        self.requests: dict[int, Request] = {}
        self.release_batches: list[int] = []  # sizes of the batched releases (``Scheduler._release_many``)
        release_many = self.sched._release_many

        def counted(requests: list[Request]) -> None:
            self.release_batches.append(len(requests))
            release_many(requests)

        self.sched._release_many = counted

    def add(self, seq: int, prompt: list[int], params: SamplingParams) -> None:
        request = Request(str(seq), seq, list(prompt), params, seq * 7 + 1, 0.0)
        self.requests[seq] = request
        self.sched.add(request)


def _fake_tokens(staging, r: int) -> tuple[np.ndarray, np.ndarray]:
    mixed = (staging.sample_seed[:r] * 1_000_003 + staging.sample_step[:r] * 7919 + 12345) % 1_000_000_007
    return mixed % VOCAB, np.ones(r, dtype=bool)


def _plan_view(plan) -> tuple:
    return (plan.step_id, plan.decode_seqs.tolist(), plan.num_tokens, plan.num_admitted,
            [(p.request.arrival_seq, p.token_row, p.start, p.num_tokens, p.samples, p.sample_step, p.first,
              p.num_cached) for p in plan.prefill],
            [r.arrival_seq for r in plan.preempted], [r.arrival_seq for r in plan.drained])


def _staging_view(meta) -> tuple:
    s, t, r = meta.staging, meta.num_tokens, meta.num_sampled
    spans = [(p.token_start, p.q_len, p.ctx_len, p.token_row, p.block_count) for p in meta.prefill_rows]
    tables = [s.prefill_block_tables[i, :p.block_count].tolist() for i, p in enumerate(meta.prefill_rows)]
    return (s.input_ids[:t].tolist(), s.positions[:t].tolist(), s.slot_mapping[:t].tolist(),
            s.token_is_output[:t].tolist(), s.token_owner_row[:t].tolist(), s.logits_indices[:r].tolist(),
            s.sample_token_rows[:r].tolist(), s.sample_step[:r].tolist(), s.sample_seed[:r].tolist(), spans,
            tables, list(meta.first_chunk_rows), meta.context_tokens)


def _parked(planner: Planner) -> list[tuple]:
    """The releases waiting to be settled, oldest first: request, blocks, outputs to hash, full blocks."""
    return [(p.request.arrival_seq, p.parked.blocks.tolist(), p.parked.chain, p.outputs.tolist(), p.num_full)
            for p in planner.sched.prefix._pending]


def _held_tables(planner: Planner) -> dict[int, list[int]]:
    blocks = planner.blocks
    return {r.arrival_seq: blocks.block_table[r.token_row, :blocks.num_row_blocks[r.token_row]].tolist()
            for r in planner.sched.running.values()}


@pytest.mark.parametrize(("seed", "min_new_run", "distinct"), [(0, None, 0.0), (1, None, 0.0), (2, None, 0.0),
                                                               (3, 1, 0.7), (4, 1, 0.7)])
def test_batched_admission_equals_one_at_a_time(seed: int, min_new_run: int | None, distinct: float) -> None:
    """``distinct``: the share of prompts of their own (no shared prefix); ``min_new_run`` 1: every run of new
    prompts at the queue's head, however short, is admitted as one (``Admitter._admit_run``), between hits, deferrals
    and evictions of the general pass."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, VOCAB) for _ in range(2 * BLOCK)] for _ in range(3)]
    batched, single = Planner(True, 72, min_new_run), Planner(False, 72)
    waves = {0: 40, 6: 60, 20: 50, 45: 70}  # arrival step -> burst size
    seq = 0
    in_flight: list = []  # (plan, tokens, finite) of both, applied one step late as in overlap mode
    for step in range(400):
        for _ in range(waves.get(step, 0)):
            if rng.random() < distinct:
                prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, 3 * BLOCK))]
            else:
                prompt = rng.choice(prefixes)[:rng.randrange(BLOCK, 2 * BLOCK + 1)] + [
                    rng.randrange(4, VOCAB) for _ in range(rng.randrange(0, 20))]
            params = SamplingParams(max_tokens=rng.randrange(1, 60), temperature=0.0,
                                    ignore_eos=rng.random() < 0.3)
            batched.add(seq, prompt, params)
            single.add(seq, prompt, params)
            seq += 1
        plans = [p.sched.schedule() for p in (batched, single)]
        assert (plans[0] is None) == (plans[1] is None)
        if plans[0] is not None:
            assert _plan_view(plans[0]) == _plan_view(plans[1])
            metas = [p.writer.write(plan, p.staging.next_buffer()) for p, plan in zip((batched, single), plans)]
            assert _staging_view(metas[0]) == _staging_view(metas[1])
            for p, plan in zip((batched, single), plans):
                p.sched.release_drained(plan)
            tokens, finite = _fake_tokens(metas[1].staging, metas[1].num_sampled)
            in_flight.append((plans, tokens, finite))
        if len(in_flight) > 1 or (in_flight and plans[0] is None):
            done, tokens, finite = in_flight.pop(0)
            applied = [p.sched.apply(plan, tokens, finite) for p, plan in zip((batched, single), done)]
            assert applied[0].seqs.tolist() == applied[1].seqs.tolist()
            assert applied[0].finish.tolist() == applied[1].finish.tolist()
        for p in (batched, single):
            p.sched.check_integrity()
        assert _held_tables(batched) == _held_tables(single)
        assert batched.blocks.free_blocks() == single.blocks.free_blocks()
        assert list(batched.blocks.prefix._lru) == list(single.blocks.prefix._lru)
        assert _parked(batched) == _parked(single)
        assert batched.sched._free_rows == single.sched._free_rows
        assert batched.sched.prefix_cache_stats() == single.sched.prefix_cache_stats()
        if step > max(waves) and not in_flight and not batched.sched.has_work():
            break
    assert not single.sched.has_work() and seq == sum(waves.values())
    stats = batched.sched.prefix_cache_stats()
    # The workload reached the paths under test: cache hits, evictions within a batch, preemptions.
    assert stats["cached_tokens"] > 0 and stats["evictions"] > 0 and batched.sched.num_preemptions > 0
    assert max(batched.release_batches) > 1  # and several drained requests were released at once
    if min_new_run == 1:  # and runs of new prompts, several of them longer than one
        assert len(batched.new_runs) > 5 and max(batched.new_runs) >= 3, batched.new_runs
    assert batched.blocks.num_free_blocks == batched.blocks.num_usable_blocks


@pytest.mark.parametrize("cut", [5, BLOCK, BLOCK + 3])
def test_a_run_of_new_prompts_ends_with_the_budgets_chunk_of_the_next(monkeypatch, cut: int) -> None:
    """A burst of new prompts whose token budget ends inside one (a burst's usual admitting step): the batched
    planner admits the whole prompts and that one's first chunk, the budget's rest, as one run (one array batch,
    ``Admitter._admit_run``); the chunked prompt then goes on prefilling. Every plan, staging write, block table,
    free stack and cache counter equals one-at-a-time admission, step by step until all have finished. ``cut``: the
    chunk's length (shorter than a block, one block, more)."""
    from asyncbatch.engine import admission

    rng = random.Random(cut)
    lengths = [30] * 15 + [BUDGET - 15 * 30 - cut, 40, 33]  # 16 whole prompts leave ``cut`` of the budget
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in lengths]
    planners = [Planner(True, 80), Planner(False, 80)]
    for p in planners:
        for i, prompt in enumerate(prompts):
            p.add(i, prompt, SamplingParams(max_tokens=3 + i % 4, temperature=0.0, ignore_eos=True))
    batches = []
    apply = admission.Admitter._apply
    monkeypatch.setattr(admission.Admitter, "_apply", lambda self, requests, *rest: (
        batches.append((self.batch, len(requests))), apply(self, requests, *rest))[1])
    for step in range(40):
        plans = [p.sched.schedule() for p in planners]
        assert (plans[0] is None) == (plans[1] is None)
        if plans[0] is None:
            break
        assert _plan_view(plans[0]) == _plan_view(plans[1])
        if step == 0:
            assert plans[0].num_admitted == 17 and sum(lengths[:16]) + cut == BUDGET
            chunk = plans[0].prefill[-1]
            assert (chunk.request.arrival_seq, chunk.num_tokens, chunk.samples) == (16, cut, False)
            assert planners[0].new_runs == [17]
            assert [n for batch, n in batches if batch] == [17]  # the chunk did not take a second batch
        metas = [p.writer.write(plan, p.staging.next_buffer()) for p, plan in zip(planners, plans)]
        assert _staging_view(metas[0]) == _staging_view(metas[1])
        tokens, finite = _fake_tokens(metas[1].staging, metas[1].num_sampled)
        for p, plan in zip(planners, plans):
            p.sched.release_drained(plan)
            p.sched.apply(plan, tokens, finite)
            p.sched.check_integrity()
        assert _held_tables(planners[0]) == _held_tables(planners[1])
        assert planners[0].blocks.free_blocks() == planners[1].blocks.free_blocks()
        assert planners[0].sched.prefix_cache_stats() == planners[1].sched.prefix_cache_stats()
    assert not any(p.sched.has_work() for p in planners)
    assert [r.num_outputs for r in planners[0].requests.values()] == [3 + i % 4 for i in range(len(prompts))]


def test_admission_batch_allocates_the_blocks_single_pops_would() -> None:
    a = BlockManager(40, BLOCK, 4, MAX_BLOCKS)
    b = BlockManager(40, BLOCK, 4, MAX_BLOCKS)
    rows, counts = np.array([2, 0, 3], dtype=np.int64), np.array([3, 0, 2], dtype=np.int64)
    a.allocate_rows(rows, counts)
    for row, count in zip(rows.tolist(), counts.tolist()):
        b.allocate(row, count * BLOCK)
    np.testing.assert_array_equal(a.block_table, b.block_table)
    np.testing.assert_array_equal(a.num_row_blocks, b.num_row_blocks)
    np.testing.assert_array_equal(a.decode_slot_base[[2, 3]], b.decode_slot_base[[2, 3]])
    assert a.free_blocks() == b.free_blocks()
    a.check_integrity(np.array([0, 2, 3]))


def test_burst_through_the_engine(make_llm) -> None:
    """A burst with shared prefixes and a tight KV cache: integrity after every step, the same tokens in overlap
    and synchronous mode, and the admission cost in ``stats()`` and the gap report."""
    rng = random.Random(5)
    prefix = [rng.randrange(256, 4000) for _ in range(40)]
    prompts = [prefix[:rng.randrange(16, 41)] + [rng.randrange(256, 4000) for _ in range(rng.randrange(1, 30))]
               for _ in range(150)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    sim = SimConfig(step_fixed_ms=0.05, per_token_us=0.0, per_context_token_ns=0.0)
    tokens = {}
    for mode in (True, False):
        llm = make_llm(device="sim", sim=sim, overlap=mode, engine_process=False, max_num_seqs=64,
                       max_num_batched_tokens=1024, num_kv_blocks=160, debug_check_integrity=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[mode] = [o.token_ids for o in outs]
        assert [len(t) for t in tokens[mode]] == [p.max_tokens for p in params]
        llm.wait_settled(5.0)
        llm.check_integrity()
        assert llm.num_free_blocks == llm.num_usable_blocks
        stats = llm.stats()
        records = llm.timeline.window()
        assert sum(r.num_admitted for r in records) >= len(prompts)  # preemption re-admits some
        assert stats["admission_us_per_request"] > 0
        assert gap_report(llm).admission_us_per_request == pytest.approx(stats["admission_us_per_request"])
        # The planner thread's CPU time in the same spans: some, and never more than their wall time (both
        # clocks read around the same code; 1 % for their granularities). Per step, 50 us more: the two clocks
        # come from different sources, and on a 2-core VM a thread-CPU span exceeded the monotonic span around
        # it by up to 22 us in 5 of 20,000 samples (2026-12-04), which failed a 1 us slack once in a suite run.
        # The total gets the sum of those bounds, not 1 % alone: this burst's steps admit a few requests each,
        # and short spans read more CPU than wall time (7.5 us spans, quiet: 80 % of them, 0.2 % in total;
        # 2026-12-05), so under a full suite's load the total once came to 1.4 % over (29.84 against 29.42 us).
        assert all(r.admit_cpu_ms <= r.admit_ms * 1.01 + 0.05 for r in records)
        admitting = [r for r in records if r.num_admitted]
        bound_us = sum(r.admit_ms * 1.01 + 0.05 for r in admitting) * 1e3 / sum(r.num_admitted for r in admitting)
        assert 0 < stats["admission_cpu_us_per_request"] <= bound_us
        assert gap_report(llm).admission_cpu_us_per_request == pytest.approx(stats["admission_cpu_us_per_request"])
        llm.close()
    assert tokens[True] == tokens[False]


def test_an_admission_that_evicts_is_seen_by_the_next_hit() -> None:
    """X's fresh blocks exhaust the free stack and evict the oldest cached block, b2 (the second block of
    prompt P); Y, admitted in the same burst, shares P's first block and must not find b2 cached any more, as
    when X's blocks are taken before Y is looked up."""
    rng = random.Random(9)
    prompt_p = [rng.randrange(4, VOCAB) for _ in range(2 * BLOCK + 1)]
    prompt_q = [rng.randrange(4, VOCAB) for _ in range(3 * BLOCK)]
    prompt_x = [rng.randrange(4, VOCAB) for _ in range(6 * BLOCK - 6)]
    prompt_y = prompt_p[:2 * BLOCK] + [rng.randrange(4, VOCAB) for _ in range(20)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    planners = [Planner(True, 11), Planner(False, 11)]
    for p in planners:
        p.add(0, prompt_p, one)
        p.add(1, prompt_q, one)
        _run_until_idle(p)  # P's two full blocks, then Q's three, are cached and evictable, oldest first
        assert p.blocks.num_unused_blocks == 5
        p.add(2, prompt_x, one)
        p.add(3, prompt_y, one)
    plans = [p.sched.schedule() for p in planners]
    assert _plan_view(plans[0]) == _plan_view(plans[1])
    assert [(r.request.arrival_seq, r.num_cached) for r in plans[0].prefill] == [(2, 0), (3, BLOCK)]
    assert _held_tables(planners[0]) == _held_tables(planners[1])
    for p in planners:
        p.sched.check_integrity()


def _run_until_idle(planner: Planner) -> None:
    while planner.sched.has_work():
        plan = planner.sched.schedule()
        meta = planner.writer.write(plan, planner.staging.next_buffer())
        planner.sched.release_drained(plan)
        planner.sched.apply(plan, *_fake_tokens(meta.staging, meta.num_sampled))


@pytest.mark.parametrize("burst", [12, 16])
def test_a_burst_into_a_full_cache_is_one_batch_with_the_blocks_single_pops_would_take(monkeypatch, burst) -> None:
    """Every block cached (a first wave ended), then a burst that hits nothing: each admission evicts. The batched
    admission decides them all in one batch (one array pass), evicting as it decides, and ends with the same rows,
    block tables, free stack, cache records and counters as admitting them one at a time. 12 requests: the general
    pass (a run of new prompts shorter than ``min_new_run``); 16: ``Admitter._admit_run``, which evicts once for
    the run."""
    from asyncbatch.engine import admission

    rng = random.Random(5)
    waves = [[[rng.randrange(4, VOCAB) for _ in range(2 * BLOCK)] for _ in range(burst)] for _ in range(2)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    planners = [Planner(True, 2 * burst + 1), Planner(False, 2 * burst + 1)]
    for p in planners:
        for i, prompt in enumerate(waves[0]):
            p.add(i, prompt, one)
        _run_until_idle(p)
        p.sched.settle_released()
        assert p.blocks.num_unused_blocks == 0 and p.sched.prefix_cache_stats()["cached_blocks"] == 2 * burst
        for i, prompt in enumerate(waves[1]):
            p.add(burst + i, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    batches = []
    apply = admission.Admitter._apply
    monkeypatch.setattr(admission.Admitter, "_apply", lambda self, requests, *rest: (
        batches.append((self.batch, len(requests))), apply(self, requests, *rest))[1])
    plans = [p.sched.schedule() for p in planners]
    assert _plan_view(plans[0]) == _plan_view(plans[1]) and plans[0].num_admitted == burst
    assert [n for batch, n in batches if batch] == [burst]  # one batch, not one per evicting request
    assert planners[0].new_runs == ([burst] if burst >= planners[0].sched.admitter.min_new_run else [])
    assert _held_tables(planners[0]) == _held_tables(planners[1])
    assert planners[0].blocks.free_blocks() == planners[1].blocks.free_blocks()
    stats = [p.sched.prefix_cache_stats() for p in planners]
    assert stats[0] == stats[1] and stats[0]["evictions"] == 2 * burst
    for p in planners:
        p.sched.check_integrity()
