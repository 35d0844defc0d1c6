"""Applying one step's sampled tokens: masks over the sampled rows, Python only for the rows that end.

Token ``i`` belongs to sampled row ``i`` of the plan (``StepPlan.sample_rows``).
A row is on the array path when its request still holds the row
(``RowState.seq[row] == plan.sample_seqs[i]``) and its logits were finite:
the token is appended to the row's history and its finish code computed by
masks (EOS, else a stop token id, else ``max_tokens`` reached). Python runs only
for rows that end, rows with stop token ids, and rows whose request left its
row after the plan (drained, preempted or finished since; ``StepApplier.off_row``):

- a finished request's token is dropped (the one-step-late finish of overlap
  mode: never emitted, never counted);
- non-finite logits end the request with an error and no token;
- a drained or preempted request gets the token on its ``Request`` counters.

Every request that ends here has been through ``Scheduler.finish`` (row and
blocks freed) before ``apply`` returns. ``StepApplier`` is the part of
``Scheduler`` that does this: the scheduler hands it the state they share and
its ``finish``, so the two sit in files of one concept each without importing
each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from asyncbatch.engine.emitted_cut import first_finish
from asyncbatch.engine.messages import AppliedStep, Finish
from asyncbatch.engine.request import Request, RequestStatus
from asyncbatch.engine.row_state import RowState
from asyncbatch.engine.step_plan import StepPlan
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.speculative.config import MAX_SPECULATIVE_TOKENS

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_I8 = np.zeros(0, dtype=np.int8)
# Plain ints: an IntEnum member lookup costs more than the array operation it feeds.
_NONE, _EOS, _STOP_TOKEN, _LENGTH = int(Finish.NONE), int(Finish.EOS), int(Finish.STOP_TOKEN), int(Finish.LENGTH)


def finish_code(token: int, params: SamplingParams, num_outputs: int, eos_token_id: int | None) -> Finish:
    """The per-request rule that the masks in ``apply_step`` compute for many rows at once."""
    if token == eos_token_id and params.eos_ends:
        return Finish.EOS
    if params.stop_token_ids and token in params.stop_token_ids:
        return Finish.STOP_TOKEN
    if num_outputs >= params.max_tokens:
        return Finish.LENGTH
    return Finish.NONE


class StepApplier:
    """``Scheduler.apply``: a step's sampled tokens into the scheduler's shared state (planner thread only).

    ``rows``, ``owners`` (token row -> request holding it) and ``off_row`` (seq -> request without a row whose
    tokens are in flight) are the scheduler's own objects, never rebound; ``finish(request, reason,
    stop_reason=None)`` ends a request and frees what it holds (``Scheduler.finish``).
    """

    def __init__(self, rows: RowState, owners: list[Request | None], off_row: dict[int, Request],
                 finish: Callable[..., None], eos_token_id: int | None) -> None:
        self.rows = rows
        self.owners = owners
        self.off_row = off_row
        self.finish = finish
        self.eos_token_id = eos_token_id
        self.vectorised = True  # apply_verified's array path (False: the position-by-position reference)
        self.reconcile_s = 0.0  # the last apply_verified's time reconciling the planner's upper bounds
        self._columns = np.arange(MAX_SPECULATIVE_TOKENS + 1, dtype=np.int64)

    def apply(self, plan: StepPlan, token_ids: np.ndarray, finite: np.ndarray, num_releases: int) -> AppliedStep:
        """Append step ``plan``'s tokens (one per sampled row, in plan order) and end requests on EOS, a stop
        token id, ``max_tokens`` or non-finite logits. Returns the kept rows (plan order) with their finish
        codes, and the seqs ended by errors. ``num_releases``: token rows the scheduler has given back so far
        (rows change hands only when released)."""
        return self._apply(plan.sample_rows, plan.sample_seqs, token_ids, finite, num_releases == plan.release_epoch)

    def _apply(self, rows: np.ndarray, seqs: np.ndarray, token_ids: np.ndarray, finite: np.ndarray,
               unreleased: bool) -> AppliedStep:
        """``apply`` for sampled rows ``rows``/``seqs`` ([R] each) and their tokens; ``unreleased``: no row was
        released since they were planned (so every row still holds its request)."""
        st = self.rows
        r = len(rows)
        if not r:
            return AppliedStep(_EMPTY_I64, _EMPTY_I64, _EMPTY_I8, [])
        tokens = np.asarray(token_ids, dtype=np.int64)  # [R]
        good = np.asarray(finite, dtype=bool)  # [R]
        # Rows change hands only when released: without a release since the plan, every row is still its own.
        on_row = None if unreleased else st.seq[rows] == seqs  # [R]
        fast = good if on_row is None else on_row & good  # [R]
        all_fast = np.count_nonzero(fast) == r
        fast_rows, fast_tokens = (rows, tokens) if all_fast else (rows[fast], tokens[fast])  # [F]

        counts = st.append_outputs(fast_rows, fast_tokens)  # [F]
        codes_fast = (counts >= st.max_tokens[fast_rows]).view(np.int8) * np.int8(_LENGTH)  # [F] LENGTH or NONE
        with_stop_ids = st.has_stop_ids[fast_rows]  # [F]
        if np.count_nonzero(with_stop_ids):
            owners = self.owners
            for i in with_stop_ids.nonzero()[0].tolist():
                if int(fast_tokens[i]) in owners[int(fast_rows[i])].params.stop_token_ids:
                    codes_fast[i] = _STOP_TOKEN
        eos = self.eos_token_id
        if eos is not None:
            hits = (fast_tokens == eos).nonzero()[0]  # [E]
            if len(hits):
                codes_fast[hits[~st.ignore_eos[fast_rows[hits]]]] = _EOS

        if all_fast:
            codes, keep = codes_fast, None
            special = codes.nonzero()[0]
        else:
            codes = np.zeros(r, dtype=np.int8)  # [R]
            codes[fast] = codes_fast
            keep = fast.copy()  # [R] rows whose token is kept
            special = (~fast | (codes != _NONE)).nonzero()[0]
        if not len(special):
            return AppliedStep(seqs, tokens, codes, [])

        errored: list[int] = []
        # The special rows' values as Python lists, read once: a finishing wave (many requests ending in one
        # step, most of their last tokens arriving off their rows) pays per row, and a numpy scalar read costs
        # more than a list's.
        n = len(special)
        kept = [True] * n if keep is None else keep[special].tolist()
        held = [True] * n if on_row is None else on_row[special].tolist()
        # In plan order: finishing frees rows and blocks, and their order is the free lists' order.
        for i, row, seq, token, code_value, ok, is_kept, is_held in zip(
                special.tolist(), rows[special].tolist(), seqs[special].tolist(), tokens[special].tolist(),
                codes[special].tolist(), good[special].tolist(), kept, held):
            if is_kept:
                code = Finish(code_value)
                self.finish(self.owners[row], code.reason, token if code is Finish.STOP_TOKEN else None)
            elif is_held:  # non-finite logits on a held row
                st.num_scheduled[row] -= 1  # this token never comes
                errored.append(seq)
                self.finish(self.owners[row], Finish.ERROR.reason)
            else:
                code = self._apply_off_row(self.off_row[seq], token, ok, errored)
                if code is not None:
                    keep[i] = True
                    codes[i] = code
        if keep is None:
            return AppliedStep(seqs, tokens, codes, errored)
        return AppliedStep(seqs[keep], tokens[keep], codes[keep], errored, keep.nonzero()[0])

    def apply_verified(self, plan: StepPlan, token_ids: np.ndarray, num_emitted: np.ndarray, finite: np.ndarray,
                       num_releases: int) -> AppliedStep:
        """A speculative engine's step: row ``i`` emitted ``token_ids[i, :num_emitted[i]]`` (``[R, 1 + depth]`` and
        ``[R]``; a prefill row, and a row with non-finite logits, one).

        First the planner's upper bounds are reconciled (``_reconcile``, timed into ``reconcile_s``); then each
        row's tokens are cut at the first that ends its request (EOS, a stop id, ``max_tokens``) and the tokens
        after it are dropped, as overlap mode drops a finished request's next token. The result has a row per
        kept sampled row (plan order) with its tokens in order (``AppliedStep.num_tokens``).

        ``vectorised`` False applies one position at a time, each through ``apply``'s rules (the reference the
        array path is tested against, ``tests/test_verified_apply.py``); its result is one token a row,
        position-major. Both leave the same state, finish requests in the same order (position, then plan
        order) and give each request the same tokens."""
        r = len(plan.sample_rows)  # 0: a step of prefill chunks that sample nothing (a prompt past the budget)
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(r, -1 if r else plan.spec_depth + 1)  # [R, W]
        if plan.spec_depth == 0:
            self.reconcile_s = 0.0
            return self.apply(plan, tokens[:, 0], finite, num_releases)
        emitted = np.asarray(num_emitted, dtype=np.int64)  # [R]
        # Rows change hands only when released: without a release since the plan, every row is still its own.
        unreleased = num_releases == plan.release_epoch and self.vectorised
        start = time.perf_counter()
        self._reconcile(plan, emitted, unreleased)
        self.reconcile_s = time.perf_counter() - start
        if not self.vectorised:
            return self._apply_by_position(plan.sample_rows, plan.sample_seqs, tokens, emitted, finite)
        return self._apply_runs(plan.sample_rows, plan.sample_seqs, tokens, emitted, np.asarray(finite, dtype=bool),
                                unreleased)

    def _apply_runs(self, rows: np.ndarray, seqs: np.ndarray, tokens: np.ndarray, emitted: np.ndarray,
                    good: np.ndarray, unreleased: bool) -> AppliedStep:
        """``apply_verified``'s array path: every row's tokens appended and cut at once (``first_finish``);
        Python only for the rows that end, and for rows whose request left them since the plan. Each array
        operation costs microseconds whatever its size, so the common step (every row held, finite) takes
        no index arrays at all."""
        st, r = self.rows, len(rows)
        if not r:
            return AppliedStep(_EMPTY_I64, _EMPTY_I64, _EMPTY_I8, [], None, _EMPTY_I64)
        on_row = None if unreleased else st.seq[rows] == seqs  # [R]
        fast = good if on_row is None else on_row & good  # [R]
        all_fast = np.count_nonzero(fast) == r
        fi = slice(None) if all_fast else fast.nonzero()[0]  # [F] sample indices of the held, finite rows
        fr, ft, fe = rows[fi], tokens[fi], emitted[fi]  # [F], [F, W], [F]
        cut = first_finish(ft, fe, st.num_outputs[fr], st.max_tokens[fr], st.ignore_eos[fr], self.eos_token_id,
                           self._stop_hits(fr, ft, fe))
        st.append_runs(fr, ft, cut.kept)
        if all_fast:
            counts, codes = cut.kept, cut.codes  # [R] tokens kept per sampled row, the Finish of its last
            ending = cut.codes.nonzero()[0]
        else:
            counts, codes = np.zeros(r, dtype=np.int64), np.zeros(r, dtype=np.int8)
            counts[fi], codes[fi] = cut.kept, cut.codes
            ending = fi[cut.codes.nonzero()[0]]
        errored: list[int] = []
        if len(ending) or not all_fast:
            self._end_rows(rows, seqs, tokens, emitted, good, fast, ending, counts, codes, errored)
        take = self._columns[:tokens.shape[1]] < counts[:, None]  # [R, W]
        if all_fast:
            return AppliedStep(seqs, tokens[take], codes, errored, None, counts)
        kept = (counts > 0).nonzero()[0]  # [K]
        return AppliedStep(seqs[kept], tokens[take], codes[kept], errored, kept, counts[kept])

    def _end_rows(self, rows: np.ndarray, seqs: np.ndarray, tokens: np.ndarray, emitted: np.ndarray,
                  good: np.ndarray, fast: np.ndarray, ending: np.ndarray, counts: np.ndarray, codes: np.ndarray,
                  errored: list[int]) -> None:
        """``_apply_runs``' Python part, in the reference's order (position, then plan order: the order rows and
        blocks reach the free lists): held rows that end at their cut (``ending``), held rows with non-finite
        logits, and every token of rows whose request left them (``counts``/``codes`` updated for those)."""
        st = self.rows
        events = [(int(counts[i]) - 1, i) for i in ending.tolist()]
        if not fast.all():
            on_row = st.seq[rows] == seqs
            events += [(0, i) for i in (on_row & ~good).nonzero()[0].tolist()]
            events += [(j, i) for i in (~on_row).nonzero()[0].tolist() for j in range(int(emitted[i]))]
        events.sort()
        for j, i in events:
            row, seq = int(rows[i]), int(seqs[i])
            if fast[i]:  # its token at position j ends it; the ones after it are dropped
                request = self.owners[row]
                code = Finish(int(codes[i]))
                self.finish(request, code.reason, int(tokens[i, j]) if code is Finish.STOP_TOKEN else None)
                self._arrived(request, int(emitted[i]) - j - 1)
            elif st.seq[row] == seq:  # non-finite logits on a held row: no token
                request = self.owners[row]
                st.num_scheduled[row] -= 1  # this token never comes
                errored.append(seq)
                self.finish(request, Finish.ERROR.reason)
                self._arrived(request, int(emitted[i]) - 1)
            else:
                code = self._apply_off_row(self.off_row[seq], int(tokens[i, j]), j > 0 or bool(good[i]), errored)
                if code is not None:
                    counts[i], codes[i] = j + 1, code

    def _stop_hits(self, rows: np.ndarray, tokens: np.ndarray, emitted: np.ndarray) -> np.ndarray | None:
        """``[F, W]``: the token is one of its row's stop ids (Python for the rows that have any; None: none has)."""
        with_stop_ids = self.rows.has_stop_ids[rows].nonzero()[0]
        if not len(with_stop_ids):
            return None
        hits = np.zeros(tokens.shape, dtype=bool)
        for k in with_stop_ids.tolist():
            stop_ids = self.owners[int(rows[k])].params.stop_token_ids
            n = int(emitted[k])
            hits[k, :n] = [t in stop_ids for t in tokens[k, :n].tolist()]
        return hits

    def _arrived(self, request: Request, n: int) -> None:
        """``n`` of ``request``'s tokens in flight arrived (applied, or dropped after it finished): no longer pending;
        it leaves ``off_row`` when none is left."""
        if n:
            request.num_pending -= n
            if request.num_pending == 0:
                del self.off_row[request.arrival_seq]

    def _apply_by_position(self, rows: np.ndarray, seqs: np.ndarray, tokens: np.ndarray, emitted: np.ndarray,
                           finite: np.ndarray) -> AppliedStep:
        """``apply_verified``'s reference path: one ``_apply`` per position."""
        parts = [self._apply(rows, seqs, tokens[:, 0], finite, False)]
        for j in range(1, int(emitted.max())):
            live = emitted > j  # [R]
            parts.append(self._apply(rows[live], seqs[live], tokens[live, j], np.ones(int(live.sum()), dtype=bool),
                                     False))
        if len(parts) == 1:
            return parts[0]
        return AppliedStep(np.concatenate([p.seqs for p in parts]), np.concatenate([p.token_ids for p in parts]),
                           np.concatenate([p.finish for p in parts]), [seq for p in parts for seq in p.errored])

    def _reconcile(self, plan: StepPlan, emitted: np.ndarray, unreleased: bool = False) -> None:
        """The planner counted every draft of ``plan``'s decode rows as accepted; ``emitted`` says how many tokens
        each row really got. A row still held takes back the difference from its computed and scheduled counts;
        a request that left its row expects that many fewer tokens in flight. ``unreleased``: no row was released
        since the plan (every row is held)."""
        nd, depth = plan.num_decode, plan.spec_depth
        if not nd:
            return
        st = self.rows
        rows, seqs = plan.decode_rows, plan.decode_seqs  # [D]
        over = depth + 1 - emitted[:nd]  # [D] drafts counted but not accepted
        held = None if unreleased else st.seq[rows] == seqs  # [D] (None: all)
        mine = slice(None) if held is None else held
        # The row keeps the blocks it reserved (at most one past what it needs, ``Scheduler.check_integrity``):
        # giving them back here and taking them again at the next plan would churn a block a row a step.
        st.num_computed[rows[mine]] -= over[mine]
        st.num_scheduled[rows[mine]] -= over[mine]
        st.spec_over[rows[mine]] -= depth
        if held is None:
            return
        for i in np.flatnonzero(~held & (over > 0)).tolist():
            request = self.off_row[int(seqs[i])]
            request.num_pending -= int(over[i])

    def _apply_off_row(self, request: Request, token: int, good: bool, errored: list[int]) -> Finish | None:
        """A token for a request that left its row after the plan; returns its code, or None if dropped."""
        self._arrived(request, 1)
        if request.status is RequestStatus.FINISHED:
            return None
        if not good:
            errored.append(request.arrival_seq)
            self.finish(request, Finish.ERROR.reason)
            return None
        request.num_outputs += 1
        if request.status is RequestStatus.WAITING:  # preempted: recomputed from these
            request.output_token_ids.append(token)
        code = finish_code(token, request.params, request.num_outputs, self.eos_token_id)
        if code is not Finish.NONE:
            self.finish(request, code.reason, token if code is Finish.STOP_TOKEN else None)
        return code
