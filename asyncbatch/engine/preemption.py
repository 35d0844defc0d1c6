"""Making room for KV blocks: which running request is preempted, and how it comes back.

When a request needs a block and none is free, the most recently admitted
running request not yet scheduled in this step is preempted; if there is none,
the request itself is. Under the priority policy (``by_priority``) the victim
is the one of largest ``(priority, arrival)`` among those and the request
itself (vLLM's choice). A preempted request gives back its blocks and token
row, re-enters the queue at its place (``queue_key``: arrival, or priority then
arrival; admission takes the queue's head), and
is recomputed later from its prompt and the outputs it had (copied out of its
row's history here); it is re-admitted only once every token sampled for it by
launched steps is back (``num_pending == 0``).

The decode phase normally needs no Python per row (``Scheduler._schedule_decode``
gives every crossing row a block at once); when the crossing rows need more
blocks than are free, ``decode_under_pressure`` replays the pass one row at a
time so that victims are chosen exactly as a sequential pass would.
``Preemptor`` is the part of ``Scheduler`` that does this: the scheduler hands
it the containers they share (never rebound, so both always see the same
requests) and the function that gives a request's row back; the preemption
count is the preemptor's own.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

import numpy as np

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.request import Request, RequestStatus
from asyncbatch.engine.row_state import NO_ROWS, RowState

_RUNNING = RequestStatus.RUNNING


def queue_key(request: Request, by_priority: bool) -> int | tuple[int, int]:
    """A request's place in the waiting queue: its arrival, or (priority policy) its priority then arrival."""
    return (request.params.priority, request.arrival_seq) if by_priority else request.arrival_seq


def enqueue(waiting: deque[Request], request: Request, by_priority: bool) -> None:
    """Put ``request`` into ``waiting`` (ordered by ``queue_key``) after every request that goes before it."""
    key = queue_key(request, by_priority)
    if not waiting or queue_key(waiting[-1], by_priority) <= key:
        waiting.append(request)  # an arrival under FCFS: no search
        return
    waiting.insert(bisect.bisect_right(waiting, key, key=lambda r: queue_key(r, by_priority)), request)


class Preemptor:
    """Victim choice and preemption over the scheduler's shared state; only the planner thread calls it.

    ``rows``, ``blocks``, ``waiting``, ``running`` (seq -> request, admission order) and ``owners`` (token row ->
    request holding it) are the scheduler's own objects; ``release`` gives a request's row and blocks back
    (``Scheduler._release``, blocks freed at once); ``settle`` frees the parked blocks of earlier releases
    (``Scheduler.settle_released``), tried before anyone is preempted. ``num_preemptions`` counts preemptions
    since the start.
    """

    def __init__(self, rows: RowState, blocks: BlockManager, waiting: deque[Request], running: dict[int, Request],
                 owners: list[Request | None], release: Callable[[Request], None],
                 settle: Callable[[], int], by_priority: bool = False) -> None:
        self.rows = rows
        self.blocks = blocks
        self.waiting = waiting
        self.running = running
        self.owners = owners
        self.release = release
        self.settle = settle
        self.by_priority = by_priority
        self.num_preemptions = 0

    def decode_under_pressure(self, rows: np.ndarray, reach: np.ndarray,
                              preempted: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """The decode pass one row at a time, as blocks run out (``reach`` ``[D]``: the tokens of KV each row
        needs after the step): returns the kept mask ``[D]`` and the indices (into the kept rows) of those
        given a block."""
        blocks = self.blocks
        kept = np.ones(len(rows), dtype=bool)
        grew: list[int] = []
        scheduled: set[int] = set()
        for i, (row, end) in enumerate(zip(rows.tolist(), reach.tolist())):
            request = self.owners[row]
            if request is None or request.status is not _RUNNING or request.token_row != row:
                kept[i] = False  # preempted earlier in this pass
                continue
            if end > int(blocks.num_row_blocks[row]) * blocks.block_size:
                if not self.reserve(request, end, lambda r: r.arrival_seq in scheduled, preempted):
                    kept[i] = False
                    continue
                grew.append(i)
            scheduled.add(request.arrival_seq)
        # Indices into the kept rows: subtract the dropped rows before each.
        dropped_before = np.cumsum(~kept)  # [D]
        grew_array = np.asarray(grew, dtype=np.int64)
        return kept, grew_array - dropped_before[grew_array] if len(grew) else NO_ROWS

    def reserve(self, request: Request, num_tokens: int, is_scheduled: Callable[[Request], bool],
                preempted: list[Request]) -> bool:
        """Make room for ``num_tokens`` of KV, preempting newer unscheduled requests if needed."""
        need = self.blocks.extra_blocks_needed(request.token_row, num_tokens)
        if not self.blocks.can_allocate(need) and self.blocks.num_parked_blocks:
            self.settle()
        while not self.blocks.can_allocate(need):
            victim = self._victim(request, is_scheduled)
            self.preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        self.blocks.allocate(request.token_row, num_tokens)
        return True

    def preempt(self, request: Request) -> None:
        """Back to the queue, to be recomputed; the caller records it in the plan's ``preempted``."""
        self.num_preemptions += 1
        request.num_preemptions += 1
        request.output_token_ids = self.rows.outputs(request.token_row)
        self.release(request)
        del self.running[request.arrival_seq]
        request.status = RequestStatus.WAITING
        enqueue(self.waiting, request, self.by_priority)  # at its place: admission keeps the queue's order

    def _victim(self, request: Request, is_scheduled: Callable[[Request], bool]) -> Request:
        """Who gives ``request`` room: the newest running request not scheduled in this step, else ``request``;
        under the priority policy the largest ``queue_key`` of those and ``request``."""
        others = (r for r in reversed(self.running.values())
                  if r is not request and r.status is _RUNNING and not is_scheduled(r))
        if not self.by_priority:
            return next(others, request)
        return max((request, *others), key=lambda r: queue_key(r, True))
