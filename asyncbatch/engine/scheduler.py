"""Iteration-level scheduler: which requests run in the next step, and how many tokens each.

Plain data in, plain data out: no tensors. Each call to ``schedule`` plans one
step:

1. running requests in the decode phase, one token each (admission order);
2. running requests still prefilling, one chunk each within the token budget;
3. waiting requests in FIFO order, while a token row, the budget and KV
   blocks allow. A preempted request waits until every token sampled for it
   by launched steps has reached the host (``num_pending == 0``); the queue
   does not overtake it, so admission stays FIFO.

When a request needs a block and none is free, the most recently admitted
running request not yet scheduled in this step is preempted (its blocks freed,
it re-enters the queue in arrival order and is recomputed later); if there is
none, the request itself is preempted.

Requests whose ``max_tokens``-th token is scheduled in this step are
*drained*: no later step includes them. They keep their blocks and token row
until the planner has written this step's metadata and calls
``release_drained``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.messages import AppliedStep, Finish
from asyncbatch.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRow:
    request: Request
    start: int  # position of the first token computed in this step
    num_tokens: int
    samples: bool  # the row's last token produces the request's next output token
    is_decode: bool  # input is the previous sampled token, read from the device token buffer


@dataclass(slots=True)
class StepPlan:
    step_id: int
    rows: list[ScheduledRow]  # decode rows first, then prefill chunks
    num_decode: int
    num_tokens: int
    preempted: list[Request] = field(default_factory=list)
    drained: list[Request] = field(default_factory=list)

    def first_scheduled_seqs(self) -> np.ndarray:
        """Requests whose prompt starts (or, after a preemption, restarts) in this step."""
        return np.asarray([row.request.arrival_seq for row in self.rows[self.num_decode:] if row.start == 0],
                          dtype=np.int64)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; preemption victims come from the end
        self._free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._step_id = 0
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def next_step_id(self) -> int:
        return self._step_id + 1

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def live_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    # -- planning ------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        budget = self.max_num_batched_tokens
        decode_rows: list[ScheduledRow] = []
        prefill_rows: list[ScheduledRow] = []
        scheduled: set[int] = set()
        preempted: list[Request] = []

        prefilling: list[Request] = []
        block_size = self.blocks.block_size
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.num_computed_tokens < request.prefill_len:
                prefilling.append(request)
                continue
            end = request.num_computed_tokens + 1
            # Fast path: the next token's KV position is inside a block the request already owns.
            if end > len(request.block_ids) * block_size and not self._reserve(request, end, scheduled, preempted):
                continue
            decode_rows.append(self._advance(request, 1, is_decode=True))
            scheduled.add(id(request))
        budget -= len(decode_rows)
        for request in prefilling:
            if request.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            n = min(request.prefill_len - request.num_computed_tokens, budget)
            if not self._reserve(request, request.num_computed_tokens + n, scheduled, preempted):
                continue
            prefill_rows.append(self._advance(request, n, is_decode=False))
            scheduled.add(id(request))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:
                break
            target = request.num_known_tokens
            n = min(target, budget)
            if not self.blocks.can_allocate(self.blocks.extra_blocks_needed(request, n)):
                break
            self.waiting.popleft()
            request.prefill_len = target
            request.num_computed_tokens = 0
            request.token_row = self._free_rows.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.blocks.allocate(request, n)
            prefill_rows.append(self._advance(request, n, is_decode=False))
            budget -= n

        rows = decode_rows + prefill_rows
        drained = [row.request for row in rows if row.request.status is RequestStatus.DRAINING]
        if drained:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if not rows:
            return None
        self._step_id += 1
        return StepPlan(self._step_id, rows, len(decode_rows), self.max_num_batched_tokens - budget,
                        preempted, drained)

    def _reserve(self, request: Request, num_tokens: int, scheduled: set[int],
                 preempted: list[Request]) -> bool:
        """Make room for ``num_tokens`` of KV, preempting newer unscheduled requests if needed."""
        need = self.blocks.extra_blocks_needed(request, num_tokens)
        while not self.blocks.can_allocate(need):
            victim = next((r for r in reversed(self.running)
                           if id(r) not in scheduled and r is not request and r.status is RequestStatus.RUNNING),
                          None)
            self._preempt(victim or request)
            preempted.append(victim or request)
            if victim is None:
                return False
        self.blocks.allocate(request, num_tokens)
        return True

    def _advance(self, request: Request, n: int, is_decode: bool) -> ScheduledRow:
        start = request.num_computed_tokens
        request.num_computed_tokens += n
        samples = request.num_computed_tokens == request.num_tokens
        if samples:
            request.num_pending += 1
            if request.num_scheduled_outputs >= request.params.max_tokens:
                request.status = RequestStatus.DRAINING
        return ScheduledRow(request, start, n, samples, is_decode)

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        request.num_preemptions += 1
        self._release(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        # Back into the queue at its arrival position, so admission stays FIFO.
        index = 0
        for index, other in enumerate(self.waiting):
            if other.arrival_seq > request.arrival_seq:
                break
        else:
            index = len(self.waiting)
        self.waiting.insert(index, request)

    # -- results ---------------------------------------------------------------
    def apply(self, plan: StepPlan, token_ids: np.ndarray, finite: np.ndarray) -> AppliedStep:
        """Take step ``plan``'s sampled tokens (one per sampling row, in row order): append them and end
        requests on EOS, a stop token id, ``max_tokens`` or non-finite logits. A token sampled for a request
        that had already finished (the one-step-late finish of overlap mode) is dropped here."""
        seqs: list[int] = []
        kept: list[int] = []
        finish: list[int] = []
        errored: list[int] = []
        tokens = token_ids.tolist()
        ok = finite.tolist()
        eos = self.eos_token_id
        i = 0
        for row in plan.rows:
            if not row.samples:
                continue
            request = row.request
            token, good = tokens[i], ok[i]
            i += 1
            request.num_pending -= 1
            if request.status is RequestStatus.FINISHED:
                continue
            if not good:
                self.finish(request, "error")
                errored.append(request.arrival_seq)
                continue
            request.output_token_ids.append(token)
            params = request.params
            code = Finish.NONE
            if token == eos and not params.ignore_eos:
                code = Finish.EOS
            elif params.stop_token_ids and token in params.stop_token_ids:
                code = Finish.STOP_TOKEN
            elif len(request.output_token_ids) >= params.max_tokens:
                code = Finish.LENGTH
            if code is not Finish.NONE:
                self.finish(request, code.reason, token if code is Finish.STOP_TOKEN else None)
            seqs.append(request.arrival_seq)
            kept.append(token)
            finish.append(code)
        return AppliedStep(np.asarray(seqs, dtype=np.int64), np.asarray(kept, dtype=np.int64),
                           np.asarray(finish, dtype=np.int8), errored)

    # -- leaving -------------------------------------------------------------
    def release_drained(self, plan: StepPlan) -> None:
        """Free what drained requests hold, once the step's metadata is written."""
        for request in plan.drained:
            self._release(request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End ``request`` now (stop token, stop string, abort, error); frees everything it holds once."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason

    def _release(self, request: Request) -> None:
        self.blocks.free(request)
        if request.token_row is not None:
            self._free_rows.append(request.token_row)
            request.token_row = None

    def check_integrity(self) -> None:
        self.blocks.check_integrity(self.live_requests())
        rows = [r.token_row for r in self.running if r.token_row is not None]
        if len(rows) != len(set(rows)) or set(rows) & set(self._free_rows):
            from asyncbatch.engine.block_manager import IntegrityError

            raise IntegrityError("a token row is held twice")
        if len(rows) + len(self._free_rows) != self.max_num_seqs:
            from asyncbatch.engine.block_manager import IntegrityError

            raise IntegrityError("token rows leaked")
