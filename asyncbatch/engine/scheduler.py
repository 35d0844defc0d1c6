"""Iteration-level scheduler: which requests run in the next step, and how many tokens each.

Plain data in, plain data out: no tensors. Each call to ``schedule`` plans one
step:

1. running requests in the decode phase, one token each (admission order);
2. running requests still prefilling, one chunk each within the token budget;
3. waiting requests in queue order (arrival; with ``priority``, vLLM's
   priority policy, priority then arrival: ``preemption.enqueue``), while a
   token row, the budget and KV blocks allow. A preempted request waits until
   every token sampled for it by launched steps has reached the host
   (``num_pending == 0``); the queue does not overtake it, so admission keeps
   the queue's order. Admissions are decided one
   by one and applied to the arrays in one batch (``admission``), so a burst
   of hundreds costs a few microseconds per request; what can be done on
   arrival (prefix chain keys, the row constants) is done in ``add``.

Planning is O(changes): a running request's counters live in ``RowState``
arrays at its token row, the decode rows are a cached array (``DecodeSet``),
and a decode step of the same requests is array arithmetic. Python runs only
for rows that cross a block boundary while blocks are short, arrive, finish,
drain or are preempted.

When a request needs a block and none is free, the most recently admitted
running request not yet scheduled in this step is preempted (``preemption``).
With prefix caching an admission starts after the cached blocks it reuses,
and full blocks become cached as ``prefix_sharing`` describes.

Requests whose ``max_tokens``-th token is scheduled in this step are
*drained*: no later step includes them. They keep their blocks and token row
until the planner has written this step's metadata and calls
``release_drained`` (or, failing that, until the next ``schedule``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from asyncbatch.engine.admission import Admitter
from asyncbatch.engine.block_manager import BlockManager, IntegrityError
from asyncbatch.engine.messages import AppliedStep
from asyncbatch.engine.preemption import Preemptor, enqueue
from asyncbatch.engine.prefix_sharing import PrefixSharer
from asyncbatch.engine.request import Request, RequestStatus
from asyncbatch.engine.row_state import NO_ROWS, NO_SEQ, DecodeSet, RowState
from asyncbatch.engine.step_apply import StepApplier
from asyncbatch.engine.step_plan import CHUNK_ROW, CHUNK_SEQ, ScheduledRow, StepPlan, sampling_chunks
from asyncbatch.speculative.config import SpeculativeConfig

__all__ = ["ScheduledRow", "Scheduler", "StepPlan"]

_RUNNING = RequestStatus.RUNNING


# Release work (registering finished requests' output blocks in the prefix cache) the planner does per launched
# step, while the step runs, as a share of the last step's device time; the rest waits for the next steps, or is
# done at once when a plan may need those blocks. The other threads of the planner's process (the sender, a
# cpu or sim device thread) need the interpreter in that time too: on a 2-core VM at 1 ms steps a 0.25 ms slice
# left a finishing wave's steps without it (profiles/speculative-intel-xeon-2core). 5 %: 50 us (two pieces of
# ``SETTLE_PIECE_BLOCKS``) at 1 ms, 1 ms at a 20 ms step.
SETTLE_STEP_SHARE = 0.05


class _DecodePart(NamedTuple):
    rows: np.ndarray  # [D] int64 token rows, admission order
    seqs: np.ndarray  # [D] int64
    positions: np.ndarray  # [D] int64
    steps: np.ndarray  # [D] int64
    grew: np.ndarray  # [G] int64 indices into rows
    version: int
    depth: int = 0  # drafts each row verifies (speculative engines)


class RequestRefused(ValueError):
    """A request the scheduler can never place; the core ends that request alone (``Finish.REFUSED``)."""


class Scheduler:
    """Owns the queue, the running set and the per-row arrays; only the planner thread calls it.

    It is composed of three parts it owns and hands its state to at construction: ``preemptor`` (victims and
    preemption), ``applier`` (``apply``: a step's sampled tokens) and ``prefix`` (prefix reuse and block
    registration). They share ``rows``, ``blocks``, ``waiting``, ``running``, ``_owners`` and ``_off_row`` by
    reference, so none of these is ever rebound.

    ``running`` maps seq -> request in admission order (preemption victims come from the end). Rows are
    held by running requests and by drained ones until ``release_drained``; a request that leaves its row
    with tokens in flight is kept in ``_off_row`` until they are back, so ``apply`` can still count them.
    """

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, *,
                 eos_token_id: int | None = None, speculative: SpeculativeConfig | None = None,
                 priority: bool = False) -> None:
        self.blocks = block_manager
        # Speculative decoding (``docs/speculative.md``): every decode row of a verify step gets 1 + depth tokens,
        # and its counters are upper bounds until ``apply`` reconciles them.
        self.speculative = speculative
        # How far past its (upper-bound) computed count a speculative row's blocks may reach: a verify step
        # reserves its 1 + d tokens after the previous step's drafts, counted as accepted until they are
        # reconciled, and the row keeps those blocks when they were not (``StepApplier._reconcile``). A reach
        # made of two steps' rejected drafts (2k tokens) can outlive both reconciliations; the newest step's own
        # tokens count in ``num_computed``, so the excess is largest when that step verifies nothing (a depth that
        # drops from k to 0: ``prefill_first``, ``disable_by_batch_size``).
        self._reserve_slack = 0 if speculative is None else 2 * speculative.num_speculative_tokens
        self.max_num_seqs = block_manager.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id
        self.max_model_len = block_manager.max_blocks_per_seq * block_manager.block_size
        self.rows = RowState(self.max_num_seqs, self.max_model_len)
        self.decode = DecodeSet()
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self._prefilling: list[Request] = []  # running requests still prefilling, admission order
        self._owners: list[Request | None] = [None] * self.max_num_seqs  # token row -> request holding it
        self._off_row: dict[int, Request] = {}  # seq -> request without a row whose tokens are in flight
        self._unreleased: list[Request] = []  # drained by the last plan, rows not yet released
        self._free_rows: list[int] = list(range(self.max_num_seqs - 1, -1, -1))
        self._step_id = 0
        self.num_releases = 0  # token rows given back so far
        # Several drained requests are released together (``_release_many``); False: one ``_release`` each, the
        # reference the batched path is tested against (``tests/test_admission_burst.py``).
        self.batch_release = True
        self.by_priority = priority  # the priority scheduling policy (``EngineConfig.scheduling_policy``)
        self.preemptor = Preemptor(self.rows, block_manager, self.waiting, self.running, self._owners,
                                   self._release_now, self.settle_released, priority)
        self.applier = StepApplier(self.rows, self._owners, self._off_row, self.finish, eos_token_id)
        self.prefix = PrefixSharer(block_manager, self.rows)
        self.admitter = Admitter(self.rows, block_manager, self.prefix, self.decode, self.waiting, self.running,
                                 self._prefilling, self._owners, self._free_rows)

    # -- queue ---------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue ``request``, or raise ``RequestRefused`` if it could never be placed (the input processor
        refuses such requests at the door; this guards the planner against one forged past it)."""
        total = len(request.prompt_token_ids) + request.params.max_tokens
        if total > self.max_model_len:
            raise RequestRefused(f"prompt + max_tokens = {total} exceeds the block table's {self.max_model_len} tokens")
        if self.blocks.blocks_for(total) > self.blocks.num_usable_blocks:
            raise RequestRefused(f"prompt + max_tokens = {total} needs more than the KV cache's "
                                 f"{self.blocks.num_usable_blocks} blocks")
        self.prefix.prepare(request)  # arrival-time work, so that admitting a burst only looks things up
        request.row_constants = RowState.constants_of(request)
        enqueue(self.waiting, request, self.by_priority)

    @property
    def num_preemptions(self) -> int:
        return self.preemptor.num_preemptions

    @property
    def next_step_id(self) -> int:
        return self._step_id + 1

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def live_requests(self) -> list[Request]:
        return [*self.running.values(), *self.waiting]

    # -- planning ------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        self.prefix.register_planned()  # normally done by ``release_drained`` of the last plan
        if self._unreleased:
            self._release_all(self._unreleased)
        if self.prefix.num_pending:
            if self._short_of_blocks():
                self.prefix.settle()  # the plan may need those blocks
            elif self.waiting:  # what may be admitted now may reuse some of them
                self.prefix.settle_reusable(itertools.islice(self.waiting, self.max_num_seqs - len(self.running)))
        preempted: list[Request] = []
        drained: list[Request] = []
        self.prefix.begin_plan()
        decode = self._schedule_decode(preempted, drained)
        budget = self.max_num_batched_tokens - len(decode.rows) * (decode.depth + 1)
        prefill: list[ScheduledRow] = []
        budget = self._schedule_prefills(prefill, budget, preempted, drained)
        admitted_before, admit_s, admit_cpu_s = self.admitter.num_admissions, self.admitter.seconds, \
            self.admitter.cpu_seconds
        budget = self.admitter.admit(prefill, budget, drained)
        if self.admitter.short_of_blocks and self.prefix.num_pending:
            # Parked blocks stopped the queue (``settle_reusable`` left them, ``_short_of_blocks`` did not see it
            # coming: a cache hit on evictable blocks takes free blocks too): free them for this plan if it
            # admitted nobody, else for the next.
            self.prefix.settle()
            if self.admitter.num_admissions == admitted_before:
                budget = self.admitter.admit(prefill, budget, drained)
        num_admitted = self.admitter.num_admissions - admitted_before
        if num_admitted:
            admit_s, admit_cpu_s = self.admitter.seconds - admit_s, self.admitter.cpu_seconds - admit_cpu_s
        for request in drained:  # no later step includes them; their rows go once the metadata is written
            del self.running[request.arrival_seq]
            if self.rows.decoding[request.token_row]:
                self.rows.decoding[request.token_row] = False
                self.decode.mark_removed()
        self._unreleased = drained
        if not len(decode.rows) and not prefill:
            self.prefix.settle()  # idle: nothing is left parked
            return None
        self._step_id += 1
        admitted = self.admitter.table if num_admitted else None
        sampling = [p for p in prefill[:len(prefill) - num_admitted] if p.samples]  # running prefills' chunks
        row_parts, seq_parts = [decode.rows], [decode.seqs]
        if sampling:
            row_parts.append(np.fromiter((p.token_row for p in sampling), np.int64, count=len(sampling)))
            seq_parts.append(np.fromiter((p.request.arrival_seq for p in sampling), np.int64, count=len(sampling)))
        if admitted is not None:
            samples = admitted[sampling_chunks(admitted, self.admitter.num_sampling)]
            row_parts.append(samples[:, CHUNK_ROW])
            seq_parts.append(samples[:, CHUNK_SEQ])
        sample_rows, sample_seqs = (decode.rows, decode.seqs) if len(row_parts) == 1 else (
            np.concatenate(row_parts), np.concatenate(seq_parts))
        return StepPlan(self._step_id, decode.rows, decode.seqs, decode.positions, decode.steps, decode.grew,
                        decode.version, prefill, self.max_num_batched_tokens - budget, sample_rows, sample_seqs,
                        self.num_releases, preempted, drained, num_admitted, admit_s if num_admitted else 0.0,
                        decode.depth, admitted, admit_cpu_s if num_admitted else 0.0,
                        self.admitter.tokens if num_admitted else [], self.admitter.reaches_outputs)

    def _schedule_decode(self, preempted: list[Request], drained: list[Request]) -> _DecodePart:
        """One token for every request in the decode phase (1 + depth in a verify step): array operations over
        the cached decode rows."""
        st, blocks = self.rows, self.blocks
        self.decode.refresh(st)
        rows, seqs, version = self.decode.rows, self.decode.seqs, self.decode.version
        if not len(rows):
            return _DecodePart(rows, seqs, NO_ROWS, NO_ROWS, NO_ROWS, version)
        depth = self._verify_depth(len(rows))
        # Rows with sampler extras verify like the others: the device scores and biases every position by its
        # output index, and the host fills a grammar row's mask of each position along its drafts
        # (``GrammarState.fill``: n-gram drafts come back with the step before; a draft model's, from the
        # device at the start of the step that checks them).
        width = depth + 1
        positions = st.num_computed[rows]  # [D] the input token's position, i.e. its KV slot (speculative: at most)
        # [D] tokens of KV the row holds once this step ran: one more, or (speculative) up to 1 + depth more,
        # never past the most it can ever need (a verify step's drafts past it are not checked).
        reach = positions + 1 if self.speculative is None else np.minimum(positions + width, st.token_cap[rows])
        grew = (reach > blocks.num_row_blocks[rows] * blocks.block_size).nonzero()[0]  # [G] need a block
        if len(grew) > blocks.num_free_blocks and blocks.num_parked_blocks:
            self.prefix.settle()
        if len(grew) > blocks.num_free_blocks:
            kept, grew = self.preemptor.decode_under_pressure(rows, reach, preempted)
            rows, seqs, positions, reach = rows[kept], seqs[kept], positions[kept], reach[kept]
            self.decode.mark_removed()  # rebuild next time, whatever this pass kept
            version = self.decode.new_version()
        elif len(grew):
            blocks.append_block(rows[grew])
        st.num_computed[rows] = positions + width
        steps = st.num_scheduled[rows]  # [D] outputs scheduled before this one
        scheduled = steps + width  # [D]
        st.num_scheduled[rows] = scheduled
        if self.speculative is None:
            ends = (scheduled >= st.max_tokens[rows]).nonzero()[0]  # [E] their last output
        else:
            # Every step gives at least one token: drained once the tokens it is sure to get reach max_tokens.
            over = st.spec_over[rows] + (width - 1)  # [D]
            st.spec_over[rows] = over
            ends = (scheduled - over >= st.max_tokens[rows]).nonzero()[0]
            positions = reach - 1  # what the metadata writer reads: the last reserved position
        for row in rows[ends].tolist():
            request = self._owners[row]
            request.status = RequestStatus.DRAINING
            drained.append(request)
        return _DecodePart(rows, seqs, positions, steps, grew, version, depth)

    def _verify_depth(self, num_decode: int) -> int:
        """Drafts each decode row verifies in this step: 0 without speculation, or when the batch is larger than
        ``disable_by_batch_size``; and what the token budget allows, less (``prefill_first``) what prefill may take
        of it this step (``_prefill_demand``)."""
        spec = self.speculative
        if spec is None:
            return 0
        if spec.disable_by_batch_size is not None and num_decode > spec.disable_by_batch_size:
            return 0
        budget = self.max_num_batched_tokens
        if spec.prefill_first:
            budget -= self._prefill_demand(budget - num_decode)
        return max(0, min(spec.num_speculative_tokens, budget // num_decode - 1))

    def _prefill_demand(self, cap: int) -> int:
        """Prefill tokens this step could schedule, counted up to ``cap``: the rest of each running request's
        prefill, then the prompts (and outputs to recompute) of the waiting requests, in FIFO order, while a
        token row and the free KV blocks would take them. An upper bound where the prefix cache would supply a
        part; O(1) with nothing waiting or prefilling, and at most ``cap`` tokens' worth of requests otherwise."""
        if cap <= 0:
            return 0
        st, blocks = self.rows, self.blocks
        demand = 0
        for request in self._prefilling:
            if request.status is _RUNNING:
                row = request.token_row
                demand += int(st.prefill_len[row]) - int(st.num_computed[row])
                if demand >= cap:
                    return cap
        free_blocks = blocks.num_free_blocks
        for request in itertools.islice(self.waiting, self.max_num_seqs - len(self.running)):
            if request.num_pending:  # admission stops at it (FIFO): nothing behind it goes in either
                break
            tokens = len(request.prompt_token_ids) + request.num_outputs
            free_blocks -= blocks.blocks_for(tokens)
            if free_blocks < 0:
                break
            demand += tokens
            if demand >= cap:
                return cap
        return demand

    def _schedule_prefills(self, prefill: list[ScheduledRow], budget: int, preempted: list[Request],
                           drained: list[Request]) -> int:
        """One chunk for each running request still prefilling, within ``budget``; returns what is left."""
        st = self.rows
        chunked: set[int] = set()

        def is_scheduled(r: Request) -> bool:
            return r.arrival_seq in chunked or bool(st.decoding[r.token_row])

        for request in list(self._prefilling):
            if request.status is not _RUNNING or budget <= 0:
                continue
            row = request.token_row
            start = int(st.num_computed[row])
            n = min(int(st.prefill_len[row]) - start, budget)
            if not self.preemptor.reserve(request, start + n, is_scheduled, preempted):
                continue
            prefill.append(self._advance_prefill(request, row, start, n, drained))
            chunked.add(request.arrival_seq)
            budget -= n
        return budget

    def _advance_prefill(self, request: Request, row: int, start: int, n: int,
                         drained: list[Request]) -> ScheduledRow:
        """The next chunk of a running request's prefill (admissions: ``Admitter``)."""
        st = self.rows
        end = start + n
        st.num_computed[row] = end
        self.prefix.note_prefill(request)
        if self.blocks.caching:
            self.prefix.note_computing(request, start, end)
        if end < st.prefill_len[row]:
            return ScheduledRow(request, row, start, n, False, 0)
        self._prefilling.remove(request)
        step = int(st.num_scheduled[row])
        st.num_scheduled[row] = step + 1
        if step + 1 >= st.max_tokens[row]:
            request.status = RequestStatus.DRAINING
            drained.append(request)
        else:
            st.decoding[row] = True
            self.decode.add(row, int(st.admit_key[row]))
        return ScheduledRow(request, row, start, n, True, step)

    # -- results -------------------------------------------------------------
    def apply(self, plan: StepPlan, token_ids: np.ndarray, finite: np.ndarray) -> AppliedStep:
        """Step ``plan``'s sampled tokens (``StepApplier.apply``)."""
        return self.applier.apply(plan, token_ids, finite, self.num_releases)

    def apply_verified(self, plan: StepPlan, token_ids: np.ndarray, num_emitted: np.ndarray,
                       finite: np.ndarray) -> AppliedStep:
        """A speculative engine's step: ``token_ids`` ``[R, 1 + depth]``, the first ``num_emitted[i]`` of row ``i``
        emitted (``StepApplier.apply_verified``)."""
        return self.applier.apply_verified(plan, token_ids, num_emitted, finite, self.num_releases)

    # -- leaving -------------------------------------------------------------
    def release_drained(self, plan: StepPlan) -> None:
        """Once ``plan``'s metadata is written (the core: once the step is launched, while it runs): register
        the full blocks its prefill chunks fill (``PrefixSharer.register_planned``), then free what drained
        requests hold. Both must happen before the next ``schedule`` (which does them itself otherwise)."""
        self.prefix.register_planned()
        self._release_all(plan.drained)

    def _release_all(self, requests: list[Request]) -> None:
        held = [r for r in requests if r.token_row is not None]
        if len(held) > 1 and self.batch_release:
            self._release_many(held)
        else:
            for request in held:
                self._release(request)
        self._unreleased = [r for r in self._unreleased if r.token_row is not None]

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End ``request`` now (stop token, stop string, abort, error); frees everything it holds once."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is _RUNNING:
            del self.running[request.arrival_seq]
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        if request.token_row is not None:
            self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason

    @property
    def num_parked_releases(self) -> int:
        """Released requests whose blocks wait for ``settle_released``."""
        return self.prefix.num_pending

    def settle_released(self, budget_s: float | None = None, stop: Callable[[], bool] | None = None) -> int:
        """Register and free the blocks of released requests (``PrefixSharer.settle``): all, or in pieces within
        ``budget_s`` seconds while ``stop()`` says no (the planner: while the step it waits for next runs).
        Returns how many are left."""
        return self.prefix.settle(budget_s, stop)

    def _short_of_blocks(self) -> bool:
        """Whether this plan might need blocks that are parked: every running row one more block (decode) plus
        a full token budget of prefill, rounded up per row."""
        need = 2 * len(self.running) + self.max_num_batched_tokens // self.blocks.block_size + 1
        return self.blocks.num_free_blocks < need

    def _release_many(self, requests: list[Request]) -> None:
        """``_release`` (parking) for each of ``requests`` (each holding a row) in order, with the row reads and
        writes and the block manager's work done once for all of them: a finishing wave releases hundreds in
        one step, on the path to the next launch."""
        st = self.rows
        rows = [request.token_row for request in requests]
        index = np.asarray(rows, dtype=np.int64)  # [R]
        num_outputs = st.num_outputs[index].tolist()
        num_scheduled = st.num_scheduled[index].tolist()
        self.prefix.release_many(requests, rows, num_outputs)
        st.seq[index] = NO_SEQ
        if st.decoding[index].any():
            st.decoding[index] = False
            self.decode.mark_removed()
        off_row, owners, free_rows, prefilling = self._off_row, self._owners, self._free_rows, self._prefilling
        for request, row, outputs, scheduled in zip(requests, rows, num_outputs, num_scheduled):
            request.num_outputs = outputs
            request.num_pending = scheduled - outputs
            if scheduled != outputs:
                off_row[request.arrival_seq] = request
            if request.status is _RUNNING and request in prefilling:
                prefilling.remove(request)
            owners[row] = None
            free_rows.append(row)
            request.token_row = None
        self.num_releases += len(requests)

    def _release_now(self, request: Request) -> None:
        """``_release`` with the blocks freed now, not parked (a preemption makes room with them)."""
        self._release(request, park=False)

    def _release(self, request: Request, park: bool = True) -> None:
        """Give back the row and its blocks; the row's counters move into ``request``. ``park``: the blocks of
        its outputs are registered and freed later (``settle_released``), off the planner's critical path."""
        st, row = self.rows, request.token_row
        request.num_outputs = int(st.num_outputs[row])
        request.num_pending = int(st.num_scheduled[row]) - request.num_outputs
        if request.num_pending:
            self._off_row[request.arrival_seq] = request
        self.prefix.release(request, row, park)
        st.seq[row] = NO_SEQ
        if st.decoding[row]:
            st.decoding[row] = False
            self.decode.mark_removed()
        if request.status is _RUNNING and request in self._prefilling:
            self._prefilling.remove(request)
        self._owners[row] = None
        self._free_rows.append(row)
        self.num_releases += 1
        request.token_row = None

    # -- prefix cache (``PrefixSharer``) -------------------------------------
    # While requests run, observers see parked releases as they are (blocks held, not yet cached): settling
    # for them would stall the planner whenever a replica reports its stats. Idle, everything is settled first
    # (``settle_if_idle``), so what an observer of an idle engine sees does not depend on when it asked. A
    # reset settles first, so that no parked block becomes cached after it.
    def settle_if_idle(self) -> None:
        if not self.has_work():
            self.prefix.settle()

    def prefix_cache_stats(self) -> dict:
        self.settle_if_idle()
        return self.prefix.stats()

    def prefix_cache_keys(self, max_blocks: int) -> list[int]:
        self.settle_if_idle()
        return self.prefix.keys(max_blocks)

    def reset_prefix_cache(self) -> bool:
        self.prefix.settle()
        return self.prefix.reset()

    def check_integrity(self) -> None:
        st = self.rows
        held = np.flatnonzero(st.seq != NO_SEQ)
        self.blocks.check_integrity(held)
        free = self._free_rows
        if len(set(free)) != len(free) or set(free) & set(held.tolist()):
            raise IntegrityError("a token row is held twice")
        if len(held) + len(free) != self.max_num_seqs:
            raise IntegrityError("token rows leaked")
        holders = [*self.running.values(), *(r for r in self._unreleased if r.token_row is not None)]
        if sorted(r.token_row for r in holders) != held.tolist():
            raise IntegrityError("held token rows differ from the running and drained requests' rows")
        for request in holders:
            row = request.token_row
            if self._owners[row] is not request or st.seq[row] != request.arrival_seq:
                raise IntegrityError(f"row {row} does not record its request {request.request_id}")
            # A speculative row may keep what it reserved for drafts that were not accepted: up to 2k tokens more.
            computed, cap = int(st.num_computed[row]), int(st.token_cap[row])
            have, slack = int(self.blocks.num_row_blocks[row]), self._reserve_slack
            if not self.blocks.blocks_for(min(computed, cap)) <= have <= self.blocks.blocks_for(min(computed + slack,
                                                                                                    cap)):
                raise IntegrityError(f"request {request.request_id} holds blocks for other than its computed tokens")
        if any(r.token_row is not None or r.status is not RequestStatus.WAITING for r in self.waiting):
            raise IntegrityError("a waiting request holds a token row")
        if not self.decode.dirty:
            expected = np.flatnonzero(st.decoding)
            expected = expected[np.argsort(st.admit_key[expected])]
            if not np.array_equal(expected, self.decode.rows):
                raise IntegrityError("the cached decode rows differ from the decoding rows in admission order")

