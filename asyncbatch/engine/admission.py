"""Admitting waiting requests: FIFO, decided one by one, applied to the row and block arrays in one batch.

A burst (a batch job, a retry storm, a replica restart) puts hundreds of
requests in the queue at once, and the step that admits them is planned while
the device runs the step before it: its planning is device idle time if it
outlasts that step. So admission is cheap per request: a short Python pass
decides who goes in (FIFO, while a token row, the token budget and KV blocks
allow, reusing cached prefix blocks), and everything that writes per-row state
is done for all of them at once with numpy (``BlockManager.allocate_rows``,
``RowState.admit_many``, the completion flags). ``Scheduler`` owns this object
and shares its state with it by reference, like ``Preemptor`` and
``StepApplier``.

Equivalence with admitting one request at a time (``tests/test_planner_equivalence.py``
holds the per-request reference). Within a batch, cached blocks are shared as
each request is decided (a later request's hit sees an earlier one's reclaimed
blocks), and fresh blocks are popped for the whole batch at the end, which
hands out the blocks single pops would, as long as they all come off the free
stack. A request whose fresh blocks would evict a cached block ends the batch
before it and is allocated alone: eviction removes cache records that a later
request's hit must not see.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import chain

import numpy as np

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.prefix_sharing import NO_HIT, PrefixSharer
from asyncbatch.engine.request import Request, RequestStatus
from asyncbatch.engine.row_state import DecodeSet, RowState
from asyncbatch.engine.step_plan import ScheduledRow

_RUNNING, _DRAINING = RequestStatus.RUNNING, RequestStatus.DRAINING


class Admitter:
    """The admission half of ``Scheduler.schedule`` (planner thread only).

    ``rows``, ``blocks``, ``prefix``, ``decode``, ``waiting``, ``running``, ``prefilling`` (running requests still
    prefilling), ``owners`` (token row -> request) and ``free_rows`` (a stack of free token rows) are the
    scheduler's own objects, never rebound. ``num_admissions`` counts admissions (re-admissions after a
    preemption included) and is each admission's key (``RowState.admit_key``); ``seconds`` is the planner time
    spent admitting them (part of the figure behind ``admission_us_per_request``). ``batch=False`` applies each
    admission as soon as it is decided, as the per-request planner did: the reference that tests hold the
    batched path to. ``short_of_blocks``: the last ``admit`` stopped at a request the free blocks could not
    hold. ``table`` is the chunk table (``step_plan``'s ``CHUNK_*`` columns) of the first chunks the last
    ``admit`` appended, one row each, in order (None when it admitted none): ``StepPlan.admitted``.
    """

    def __init__(self, rows: RowState, blocks: BlockManager, prefix: PrefixSharer, decode: DecodeSet,
                 waiting: deque[Request], running: dict[int, Request], prefilling: list[Request],
                 owners: list[Request | None], free_rows: list[int], batch: bool = True) -> None:
        self.rows = rows
        self.blocks = blocks
        self.prefix = prefix
        self.decode = decode
        self.waiting = waiting
        self.running = running
        self.prefilling = prefilling
        self.owners = owners
        self.free_rows = free_rows
        self.batch = batch  # False: each admission is applied as it is decided (the one-at-a-time reference)
        self.max_num_seqs = blocks.max_num_seqs
        self.num_admissions = 0
        self.seconds = 0.0
        self.table: np.ndarray | None = None
        self.short_of_blocks = False  # the last ``admit`` stopped at a request its free blocks could not hold
        self._tables: list[np.ndarray] = []

    def admit(self, prefill: list[ScheduledRow], budget: int, drained: list[Request]) -> int:
        """Admit waiting requests in FIFO order while a row, the budget and blocks allow; append their first
        chunks to ``prefill`` and the ones whose only output is scheduled now to ``drained``. Returns the budget
        left."""
        waiting = self.waiting
        self.table = None
        self.short_of_blocks = False
        if not waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return budget
        started = time.perf_counter()
        blocks, prefix, free_rows = self.blocks, self.prefix, self.free_rows
        caching = blocks.caching
        rows_left = self.max_num_seqs - len(self.running)
        available = blocks.num_free_blocks  # fresh + reclaimable: what the admissions may take
        unused = blocks.num_unused_blocks  # on the free stack: fresh blocks popped without evicting
        batch: list[Request] = []
        numbers: list[tuple[int, int, int, int, int, int]] = []  # each one's (row, target, start, n, fresh, prompt)
        prompt_tokens = cached_tokens = 0
        while waiting and budget > 0 and rows_left > 0:
            request = waiting[0]
            if request.num_pending:  # a preempted request waits for its in-flight tokens; nobody overtakes it
                break
            prompt_len = len(request.prompt_token_ids)
            target = prompt_len + request.num_outputs
            hit = prefix.hit(request, target) if caching else NO_HIT
            start = hit.num_tokens
            n = min(target - start, budget)
            fresh = blocks.blocks_for(start + n) - len(hit.cached)
            if fresh + hit.num_reclaimed > available:
                self.short_of_blocks = True
                break
            if fresh > unused and batch:  # it evicts: apply the batch first, so its hit saw no eviction
                self._apply(batch, numbers, prefill, drained)
                batch, numbers = [], []
                unused = blocks.num_unused_blocks
            waiting.popleft()
            row = free_rows.pop()
            if caching:
                prompt_tokens += target
                cached_tokens += start
                if start:
                    prefix.share(row, hit)
            batch.append(request)
            numbers.append((row, target, start, n, fresh, prompt_len))
            if fresh > unused or not self.batch:  # an evicting request alone: later hits must see what it evicted
                self._apply(batch, numbers, prefill, drained)
                batch, numbers = [], []
                available = blocks.num_free_blocks
                unused = blocks.num_unused_blocks
            else:
                available -= fresh + hit.num_reclaimed
                unused -= fresh
            budget -= n
            rows_left -= 1
        if batch:
            self._apply(batch, numbers, prefill, drained)
        tables = self._tables
        if tables:
            self.table = tables[0] if len(tables) == 1 else np.concatenate(tables)
            tables.clear()
        if caching:
            prefix.count_admissions(prompt_tokens, cached_tokens)
        self.seconds += time.perf_counter() - started
        return budget

    def _apply(self, requests: list[Request], numbers: list[tuple[int, int, int, int, int, int]],
               prefill: list[ScheduledRow], drained: list[Request]) -> None:
        """Rows, blocks and first chunks of the decided admissions ``requests`` (in FIFO order), with their
        ``numbers`` (row, target, start, n, fresh, prompt length) from ``admit``."""
        st = self.rows
        a = len(requests)
        table = np.fromiter(chain.from_iterable(numbers), dtype=np.int64, count=6 * a).reshape(a, 6)
        rows, targets, starts, ns, prompt_lens = table[:, 0], table[:, 1], table[:, 2], table[:, 3], table[:, 5]
        keys = np.arange(self.num_admissions + 1, self.num_admissions + 1 + a, dtype=np.int64)  # [A]
        self.num_admissions += a
        self.blocks.allocate_rows(rows, table[:, 4])
        st.admit_many(rows, requests, keys, targets, targets - prompt_lens)
        ends = starts + ns  # [A]
        st.num_computed[rows] = ends
        steps = st.num_scheduled[rows]  # [A] outputs scheduled before the first chunk: a recompute's outputs
        complete = ends == targets  # [A] the chunk ends the prefill and samples
        st.num_scheduled[rows[complete]] = steps[complete] + 1
        drains = complete & (steps + 1 >= st.max_tokens[rows])  # [A] its only output left is scheduled now
        decodes = complete & ~drains
        st.decoding[rows[decodes]] = True
        self.decode.add_many(rows[decodes], keys[decodes])
        self.prefix.note_prefills(requests)
        sample_steps = steps * complete  # [A]
        # [A, 9] their chunk table (step_plan's CHUNK_* columns): what write_prefill and the sampled rows read
        self._tables.append(np.stack([rows, starts, ns, prompt_lens, sample_steps, complete, np.ones_like(rows),
                                      starts, st.seq[rows]], axis=1))
        owners, running = self.owners, self.running
        for request, row, start, n, samples, step, drains_now in zip(
                requests, rows.tolist(), starts.tolist(), ns.tolist(), complete.tolist(),
                sample_steps.tolist(), drains.tolist()):
            owners[row] = request
            request.token_row = row
            running[request.arrival_seq] = request
            if drains_now:
                request.status = _DRAINING
                drained.append(request)
            else:
                request.status = _RUNNING
                if not samples:
                    self.prefilling.append(request)
            prefill.append(ScheduledRow(request, row, start, n, samples, step, True, start))
