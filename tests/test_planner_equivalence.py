"""The array planner against the per-request planner of 8a388b8 (``planner_reference``), in lockstep.

Both plan the same random workloads (chunked prefill, preemption under block
pressure, sampling parameters, stop token ids, EOS, non-finite logits, stop
strings and aborts from the frontend, lag 0/1/2 between launch and apply) and
every step must agree: the plan, the staging-buffer contents the executors
read, the ``StepMeta`` header, the free lists, and what ``apply`` reports.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_reference import RefBlocks, RefRequest, RefScheduler, RefWriter

from asyncbatch.engine.block_manager import BlockManager, blocks_for_tokens
from asyncbatch.engine.host_staging import StagingBuffer, StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.sampling_params import SamplingParams

VOCAB = 20
EOS = 3
MAX_PROMPT, MAX_OUTPUT = 40, 24


@dataclass(frozen=True)
class Spec:
    arrival: int
    prompt_len: int
    params: SamplingParams
    stop_string_after: int | None  # the frontend ends the request after this many outputs
    abort_at: int | None  # the frontend aborts it at this step


def sampling_params(draw_int, draw_bool) -> SamplingParams:
    greedy = draw_bool()
    return SamplingParams(
        max_tokens=draw_int(1, MAX_OUTPUT), temperature=0.0 if greedy else 0.5 + draw_int(0, 3) / 4,
        top_k=draw_int(-1, 3), top_p=1.0 if draw_bool() else 0.9, min_p=0.0 if draw_bool() else 0.05,
        presence_penalty=0.0 if draw_int(0, 3) else 0.5, ignore_eos=draw_int(0, 3) == 0,
        stop_token_ids=[] if draw_bool() else [draw_int(0, VOCAB - 1)], seed=draw_int(0, 1000))


@st.composite
def specs(draw) -> list[Spec]:
    n = draw(st.integers(1, 20))
    out = []
    for _ in range(n):
        def draw_int(lo: int, hi: int) -> int:
            return draw(st.integers(lo, hi))

        def draw_bool() -> bool:
            return draw(st.booleans())

        out.append(Spec(draw_int(0, 25), draw_int(1, MAX_PROMPT), sampling_params(draw_int, draw_bool),
                        draw(st.one_of(st.none(), st.integers(1, MAX_OUTPUT))),
                        draw(st.one_of(st.none(), st.integers(0, 40)))))
    return out


def device_tokens(staging: StagingBuffer, r: int) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic fake device: tokens and finiteness from each row's seed and sample step."""
    seeds, steps = staging.sample_seed[:r].tolist(), staging.sample_step[:r].tolist()
    mixed = [((seed * 1_000_003 + step * 7919 + 12345) * 2654435761) % 2**32 for seed, step in zip(seeds, steps)]
    return (np.asarray([m % VOCAB for m in mixed], dtype=np.int64),
            np.asarray([(m >> 8) % 64 != 0 for m in mixed], dtype=bool))


def assert_same_staging(new: StagingBuffer, ref: StagingBuffer, meta, ref_meta: dict, block_size: int) -> None:
    """The regions the executors read, array by array, and the header."""
    t, nd, r = ref_meta["num_tokens"], ref_meta["num_decode"], ref_meta["num_sampled"]
    npre = len(ref_meta["prefill_rows"])
    for name in ("positions", "slot_mapping", "token_is_output", "token_owner_row"):
        np.testing.assert_array_equal(getattr(new, name)[:t], getattr(ref, name)[:t], err_msg=name)
    np.testing.assert_array_equal(new.input_ids[nd:t], ref.input_ids[nd:t], err_msg="input_ids")
    for name in ("decode_token_rows", "decode_context_lens"):
        np.testing.assert_array_equal(getattr(new, name)[:nd], getattr(ref, name)[:nd], err_msg=name)
    for i in range(nd):  # past a row's last block a table holds stale ids that nothing reads
        nb = int(ref.positions[i]) // block_size + 1
        np.testing.assert_array_equal(new.decode_block_tables[i, :nb], ref.decode_block_tables[i, :nb],
                                      err_msg=f"decode block table of row {i}")
    for p, (_, _, _, _, nb) in enumerate(ref_meta["prefill_rows"]):
        np.testing.assert_array_equal(new.prefill_block_tables[p, :nb], ref.prefill_block_tables[p, :nb],
                                      err_msg=f"prefill block table of row {p}")
    np.testing.assert_array_equal(new.prefill_row_spans[:npre], ref.prefill_row_spans[:npre])
    nf = len(ref_meta["first_chunk_rows"])
    np.testing.assert_array_equal(new.first_chunk_token_rows[:nf], ref.first_chunk_token_rows[:nf])
    for name in ("logits_indices", "sample_token_rows", "sample_seed", "sample_step", "sample_top_k",
                 "sample_temperature", "sample_top_p", "sample_min_p", "sample_presence", "sample_frequency",
                 "sample_repetition"):
        np.testing.assert_array_equal(getattr(new, name)[:r], getattr(ref, name)[:r], err_msg=name)
    header = {f: getattr(meta, f) for f in ref_meta if f != "prefill_rows"}
    header["prefill_rows"] = [(p.token_start, p.q_len, p.ctx_len, p.token_row, p.block_count)
                              for p in meta.prefill_rows]
    assert header == ref_meta


class Lockstep:
    """Drives the array planner and the reference with the same requests, tokens and frontend events."""

    def __init__(self, specs_: list[Spec], block_size: int, num_blocks: int, max_seqs: int, budget: int,
                 lag: int, min_new_run: int | None = None) -> None:
        max_blocks = blocks_for_tokens(MAX_PROMPT + MAX_OUTPUT, block_size)
        self.blocks = BlockManager(num_blocks, block_size, max_seqs, max_blocks)
        self.sched = Scheduler(self.blocks, budget, eos_token_id=EOS)
        if min_new_run is not None:  # 1: every run of new prompts at the queue's head takes the run path
            self.sched.admitter.min_new_run = min_new_run
        self.writer = StepMetadataWriter(self.sched.rows, self.blocks)
        self.staging = StagingPair(budget, max_seqs, max_blocks, pinned=False)
        self.ref_blocks = RefBlocks(num_blocks, block_size)
        self.ref = RefScheduler(self.ref_blocks, max_seqs, budget, EOS)
        self.ref_writer = RefWriter(max_seqs, max_blocks, block_size)
        self.ref_staging = StagingPair(budget, max_seqs, max_blocks, pinned=False)
        self.block_size, self.lag = block_size, lag
        capacity = (num_blocks - 1) * block_size
        self.specs = [s for s in sorted(specs_, key=lambda s: s.arrival)
                      if s.prompt_len + s.params.max_tokens <= capacity]  # refused at submission otherwise
        self.new: dict[int, Request] = {}
        self.old: dict[int, RefRequest] = {}
        self.outputs: dict[int, int] = {}
        self.in_flight: deque = deque()
        self.stats = {"preemptions": 0, "drained": 0, "eos": 0, "stop": 0, "errors": 0, "dropped": 0}

    def frontend_finish(self, seq: int, reason: str) -> None:
        self.sched.finish(self.new[seq], reason)
        self.ref.finish(self.old[seq], reason)

    def run(self, max_steps: int = 3000) -> None:
        for step in range(max_steps):
            for seq, spec in enumerate(self.specs):
                if spec.arrival == step:
                    prompt = [(seq * 7 + j) % 100 + VOCAB for j in range(spec.prompt_len)]
                    self.new[seq] = Request(str(seq), seq, list(prompt), spec.params, spec.params.seed, 0.0)
                    self.old[seq] = RefRequest(seq, list(prompt), spec.params, spec.params.seed)
                    self.sched.add(self.new[seq])
                    self.ref.waiting.append(self.old[seq])
                if spec.abort_at == step and seq in self.new and not self.new[seq].finished:
                    self.frontend_finish(seq, "abort")
            planned = self.plan_one()
            if self.in_flight and (len(self.in_flight) > self.lag or not planned):
                self.apply_one(*self.in_flight.popleft())
            self.sched.check_integrity()
            if step > 30 and not self.sched.has_work() and not self.in_flight:
                break
        assert not self.sched.has_work() and not self.ref.running and not self.ref.waiting
        assert all(r.finished and r.num_pending == 0 for r in self.new.values())
        assert not self.sched._off_row
        assert self.blocks.num_free_blocks == self.blocks.num_usable_blocks

    def plan_one(self) -> bool:
        plan, ref_plan = self.sched.schedule(), self.ref.schedule()
        assert (plan is None) == (ref_plan is None)
        if plan is None:
            return False
        nd = ref_plan.num_decode
        assert (plan.step_id, plan.num_decode, plan.num_tokens) == (ref_plan.step_id, nd, ref_plan.num_tokens)
        assert plan.decode_seqs.tolist() == [row.request.arrival_seq for row in ref_plan.rows[:nd]]
        assert [(p.request.arrival_seq, p.token_row, p.start, p.num_tokens, p.samples) for p in plan.prefill] == [
            (r.request.arrival_seq, r.request.token_row, r.start, r.num_tokens, r.samples) for r in ref_plan.rows[nd:]]
        assert [r.arrival_seq for r in plan.preempted] == [r.arrival_seq for r in ref_plan.preempted]
        assert [r.arrival_seq for r in plan.drained] == [r.arrival_seq for r in ref_plan.drained]
        assert plan.first_scheduled()[0].tolist() == [
            r.request.arrival_seq for r in ref_plan.rows[nd:] if r.start == 0]
        self.stats["preemptions"] += len(plan.preempted)
        self.stats["drained"] += len(plan.drained)
        staging, ref_staging = self.staging.next_buffer(), self.ref_staging.next_buffer()
        meta = self.writer.write(plan, staging)
        ref_meta = self.ref_writer.write(ref_plan, ref_staging)
        assert_same_staging(staging, ref_staging, meta, ref_meta, self.block_size)
        self.sched.release_drained(plan)
        self.ref.release_drained(ref_plan)
        assert self.blocks.free_blocks() == self.ref_blocks.free_list
        assert self.sched._free_rows == self.ref.free_rows
        tokens, finite = device_tokens(ref_staging, meta.num_sampled)
        self.in_flight.append((plan, ref_plan, tokens, finite))
        return True

    def apply_one(self, plan, ref_plan, tokens: np.ndarray, finite: np.ndarray) -> None:
        num_sampled = len(tokens)
        applied = self.sched.apply(plan, tokens, finite)
        expected = self.ref.apply(ref_plan, tokens, finite)
        np.testing.assert_array_equal(applied.seqs, expected.seqs)
        np.testing.assert_array_equal(applied.token_ids, expected.token_ids)
        np.testing.assert_array_equal(applied.finish, expected.finish)
        assert applied.errored == expected.errored
        assert applied.seqs.dtype == np.int64 and applied.token_ids.dtype == np.int64
        assert applied.finish.dtype == np.int8
        self.stats["errors"] += len(applied.errored)
        self.stats["dropped"] += num_sampled - len(applied.seqs) - len(applied.errored)
        self.stats["eos"] += int((applied.finish == 1).sum())
        self.stats["stop"] += int((applied.finish == 2).sum())
        for seq in applied.seqs.tolist():
            self.outputs[seq] = self.outputs.get(seq, 0) + 1
        for seq in set(applied.seqs.tolist()):
            new, old = self.new[seq], self.old[seq]
            assert (new.status, new.finish_reason, new.stop_reason) == (old.status, old.finish_reason,
                                                                        old.stop_reason)
            after = self.specs[seq].stop_string_after
            if after is not None and self.outputs[seq] >= after and not new.finished:
                self.frontend_finish(seq, "stop")
        assert self.blocks.free_blocks() == self.ref_blocks.free_list
        assert self.sched.num_preemptions == self.ref.num_preemptions


@settings(max_examples=120, deadline=None)
@given(workload=specs(), block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(6, 60),
       max_seqs=st.integers(1, 8), extra_budget=st.integers(0, 40), lag=st.sampled_from([0, 1, 2]),
       min_new_run=st.sampled_from([None, 1]))
def test_array_planner_matches_the_per_request_planner(workload, block_size, num_blocks, max_seqs, extra_budget,
                                                       lag, min_new_run):
    Lockstep(workload, block_size, num_blocks, max_seqs, max_seqs + extra_budget, lag, min_new_run).run()


def random_workload(rng: random.Random, n: int, arrivals: int) -> list[Spec]:
    return [Spec(rng.randrange(arrivals), rng.randint(1, MAX_PROMPT),
                 sampling_params(rng.randint, lambda: rng.random() < 0.5),
                 rng.choice([None, rng.randint(1, MAX_OUTPUT)]),
                 rng.choice([None] * 4 + [rng.randrange(arrivals + 20)]))
            for _ in range(n)]


def test_long_random_workloads_cover_every_path():
    """Larger seeded workloads; each path of the comparison must actually be taken."""
    totals: dict[str, int] = {}
    for seed, (block_size, num_blocks, max_seqs, budget, lag) in enumerate(
            [(4, 40, 8, 24, 1), (16, 12, 16, 64, 1), (1, 90, 6, 20, 0), (2, 50, 12, 40, 2), (4, 30, 32, 48, 1)]):
        workload = random_workload(random.Random(seed), 150, 120)
        run = Lockstep(workload, block_size, num_blocks, max_seqs, budget, lag, 1 if seed % 2 else None)
        run.run()
        for key, value in run.stats.items():
            totals[key] = totals.get(key, 0) + value
    assert all(totals[key] > 0 for key in totals), totals
