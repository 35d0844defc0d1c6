"""Admitting waiting requests: in queue order, decided one by one, applied to the row and block arrays in one batch.

A burst (a batch job, a retry storm, a replica restart) puts hundreds of
requests in the queue at once, and the step that admits them is planned while
the device runs the step before it: its planning is device idle time if it
outlasts that step. So admission is cheap per request: a short Python pass
decides who goes in (the queue's order, FIFO unless the priority policy
orders it, while a token row, the token budget and KV blocks
allow, reusing cached prefix blocks) and works out, as plain integers, every
number the admission sets: one row of an int64 table per request (its chunk,
``RowState``'s counters, where its blocks go). Everything that writes per-row
state is then done for all of them at once with numpy, a few scatters from
that table (``BlockManager.allocate_admitted``, ``RowState.admit_many``), and
the table's chunk columns are what the metadata writer reads
(``StepPlan.admitted``). No reduction or prefix sum over the batch is left
to numpy: a step's fixed cost is a handful of array operations, which matters
most where the caches are cold (the step after the planner slept) and the
batch small (long prompts leave the token budget room for a few).
``Scheduler`` owns this object and shares its state with it by reference,
like ``Preemptor`` and ``StepApplier``.

Equivalence with admitting one request at a time (``tests/test_planner_equivalence.py``
holds the per-request reference). Within a batch, cached blocks are shared as
each request is decided (a later request's hit sees an earlier one's reclaimed
blocks), and fresh blocks are popped for the whole batch at the end, which
hands out the blocks single pops would. Once the free stack cannot hold a
request's fresh blocks, the rest are evicted from the cache as that request is
decided (``BlockManager.evict_for_admission``: least recently released first,
as its single pops would), so a later request's hit no longer sees them, and
the batch's pop hands them out after the stack. A request whose next block to
reuse is one that a chunk of this plan computes waits a step, at the head of the
queue, and then reuses it (``PrefixSharer.waits_for_computing``); the requests
behind it may be admitted meanwhile, up to the rows the waiting ones leave. A
server that has run a while
has its free blocks nearly all cached, so this is a burst's usual path there:
it costs an admission one dict removal a block, where applying each evicting
request alone cost it a batch's fixed array work
(profiles/admission-burst-amd-epyc-2core: 30 -> 6 us a request).

Most of a burst is new prompts that miss the cache, and for those the pass's
decisions reduce to prefix sums (budget, rows, blocks; each prompt whole, but
the last that the budget cuts short). So a run of at least ``MIN_NEW_RUN`` of
them at the queue's head is admitted as one (``_new_prompt_run`` finds it,
``_admit_run`` admits it): a few statements per ``Request`` and the table
built by column operations, what the general pass decides for each of them,
with what that pass decided first applied before it (the pop order). It
halves the pass's Python for a burst of distinct prompts
(profiles/admission-new-prompt-runs-amd-epyc-zen1-2core).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import chain, islice

import numpy as np

from asyncbatch.engine.block_manager import BlockManager, IntegrityError
from asyncbatch.engine.prefix_sharing import NO_HIT, PrefixSharer
from asyncbatch.engine.request import Request, RequestStatus
from asyncbatch.engine.row_state import ROW_COUNTERS, DecodeSet, RowState
from asyncbatch.engine.step_contract import blocks_for_tokens
from asyncbatch.engine.step_plan import (
    CHUNK_BLOCKS,
    CHUNK_COLUMNS,
    CHUNK_END,
    CHUNK_FIRST,
    CHUNK_N,
    CHUNK_OFFSET,
    CHUNK_PROMPT,
    CHUNK_ROW,
    CHUNK_SAMPLES,
    CHUNK_SEQ,
    ScheduledRow,
)

_RUNNING, _DRAINING = RequestStatus.RUNNING, RequestStatus.DRAINING
# Columns of the admission table (built by ``Admitter.admit``): step_plan's chunk table (CHUNK_ROW .. CHUNK_SEQ), whose
# last two columns, the chunk's end and the request's seq, are also the first two of ``RowState``'s counters
# (``ROW_COUNTERS``: num_computed, seq, ...); then what the blocks need (the blocks the row gets fresh, the index
# of its last one among those the batch pops, and where its first goes in the flattened block table less its
# index among them), and whether it decodes after this step.
_COUNTERS = slice(CHUNK_END, CHUNK_END + len(ROW_COUNTERS))
_ADMIT_KEY = CHUNK_END + ROW_COUNTERS.index("admit_key")
_PREFILL_LEN, _SCHEDULED, _TOKEN_CAP = (CHUNK_END + ROW_COUNTERS.index(name)
                                        for name in ("prefill_len", "num_scheduled", "token_cap"))
_FRESH, _LAST, _FLAT, _DECODES = range(_COUNTERS.stop, _COUNTERS.stop + 4)
_TABLE_WIDTH = _DECODES + 1
# The admission table's row for every request of a run of new prompts (``Admitter._admit_run``) in the columns they
# share: whole prompts from position 0, nothing cached, sampling at step 0 with no outputs before, decoding after.
_RUN_CONSTANTS = np.zeros(_TABLE_WIDTH, dtype=np.int64)
_RUN_CONSTANTS[[CHUNK_SAMPLES, CHUNK_FIRST, _SCHEDULED, _DECODES]] = 1


class Admitter:
    """The admission half of ``Scheduler.schedule`` (planner thread only).

    ``rows``, ``blocks``, ``prefix``, ``decode``, ``waiting``, ``running``, ``prefilling`` (running requests still
    prefilling), ``owners`` (token row -> request) and ``free_rows`` (a stack of free token rows) are the
    scheduler's own objects, never rebound. ``num_admissions`` counts admissions (re-admissions after a
    preemption included) and is each admission's key (``RowState.admit_key``); ``seconds`` is the planner time
    spent admitting them (part of the figure behind ``admission_us_per_request``), ``cpu_seconds`` the planner
    thread's CPU time in it (``admission_cpu_us_per_request``). ``batch=False`` applies each
    admission as soon as it is decided, as the per-request planner did: the reference that tests hold the
    batched path to. ``short_of_blocks``: the last ``admit`` stopped at a request the free blocks could not
    hold. ``table`` is the chunk table (``step_plan``'s ``CHUNK_*`` columns) of the first chunks the last
    ``admit`` appended, one row each, in order (None when it admitted none): ``StepPlan.admitted``; ``tokens``
    their tokens, one int64 array each in the same order (``StepPlan.admitted_tokens``).
    """

    # The shortest run of new prompts admitted as one (``_admit_run``); shorter ones take the general pass, since a
    # run's array work costs about what 10-15 requests' Python costs there.
    MIN_NEW_RUN = 16

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
        self.max_blocks_per_seq = blocks.max_blocks_per_seq
        self.num_admissions = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.table: np.ndarray | None = None
        self.tokens: list[np.ndarray] = []
        self.num_sampling = 0  # of the last ``admit``'s chunks, those that end their prefill and sample
        # Whether one of the last ``admit``'s chunks reaches a preempted request's outputs (its end past its prompt).
        self.reaches_outputs = False
        self.short_of_blocks = False  # the last ``admit`` stopped at a request its free blocks could not hold
        self.min_new_run = self.MIN_NEW_RUN  # tests and the planner's warm-up set 1
        self._tables: list[np.ndarray] = []

    def admit(self, prefill: list[ScheduledRow], budget: int, drained: list[Request]) -> int:
        """Admit waiting requests in queue order while a row, the budget and blocks allow; append their first
        chunks to ``prefill`` and the ones whose only output is scheduled now to ``drained``. Returns the budget
        left."""
        waiting = self.waiting
        self.table = None
        self.tokens = tokens = []  # a new list: the last plan keeps the one before
        self.num_sampling = 0
        self.reaches_outputs = False
        self.short_of_blocks = False
        if not waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return budget
        started, started_cpu = time.perf_counter(), time.thread_time()
        blocks, prefix, free_rows = self.blocks, self.prefix, self.free_rows
        owners, running, prefilling = self.owners, self.running, self.prefilling
        caching = blocks.caching
        cached = prefix.cached_keys() if caching else ()  # live: evictions below leave it
        computing = prefix.computing  # live: keys of blocks this plan's chunks complete (grows below)
        rows_left = self.max_num_seqs - len(self.running)
        available = blocks.num_free_blocks  # fresh + reclaimable: what the admissions may take
        unused = blocks.num_unused_blocks  # on the free stack: fresh blocks popped without evicting
        batch: list[Request] = []
        # Each one's row of the admission table (columns as ``_apply`` reads them), built in this Python pass so
        # that applying a batch and writing its metadata are a few array operations whatever its size, none of
        # them a reduction or a prefix sum over the batch.
        records: list[tuple[int, ...]] = []
        popped = 0  # fresh blocks the batch takes so far
        num_tokens = 0  # tokens of the chunks decided so far
        key = self.num_admissions  # the last admission's key
        max_blocks, bs = self.max_blocks_per_seq, blocks.block_size
        prompt_tokens = cached_tokens = 0
        num_sampling = 0
        num_decoding = 0  # of the chunks not applied yet, those that decode after this step
        deferred: list[Request] = []  # waiting a step for blocks this plan computes, in queue order
        # Requests the general pass decides before the next look for a run of new prompts, and how far a look that
        # finds none puts off the next: doubling, so a burst of cache hits costs a few looks, not one a request.
        look_in, look_back = 0, 1
        while waiting and budget > 0 and rows_left > 0:
            if look_in <= 0 and self.batch and len(waiting) >= self.min_new_run:
                run = self._new_prompt_run(budget, rows_left, available)
                if len(run.requests) >= self.min_new_run:
                    if batch:  # what the general pass decided first takes its blocks first, as single pops would
                        self._apply(batch, _table(records), popped, num_decoding)
                        batch, records, popped, num_decoding = [], [], 0, 0
                    self._admit_run(run, prefill, key, num_tokens)
                    a = len(run.requests)
                    key += a
                    num_tokens += run.num_tokens
                    budget -= run.num_tokens
                    rows_left -= a
                    num_sampling += a - run.chunked
                    prompt_tokens += run.prompt_tokens
                    available, unused = blocks.num_free_blocks, blocks.num_unused_blocks
                    look_back = 1
                    continue
                look_in = max(len(run.requests) + 1, look_back)  # at least the short run and the request ending it
                look_back = min(2 * look_back, 64)
            look_in -= 1
            request = waiting[0]
            if request.num_pending:  # a preempted request waits for its in-flight tokens; nobody overtakes it
                break
            prompt_len = len(request.prompt_token_ids)
            target = prompt_len + request.num_outputs
            # A new prompt whose first block is not cached misses (``PrefixSharer.hit``'s first check), decided
            # here without a call: a burst of distinct prompts is all misses. Recomputes after a preemption
            # (outputs to hash) and possible hits take the full lookup.
            keys = request.block_keys
            hit = prefix.hit(request, target) if caching and (request.num_outputs or keys and keys[0] in cached) \
                else NO_HIT
            shared = len(hit.cached)
            following = keys[shared] if shared < len(keys) else None  # the key of the first block it would compute
            # A request whose next block to reuse is computed by a chunk of this plan waits a step and reuses it
            # (``PrefixSharer.waits_for_computing``). The requests behind it may go first, but not into the rows
            # the waiting ones will need: it keeps its place at the head of the queue.
            if following in computing and prefix.waits_for_computing(request, target, shared):
                deferred.append(waiting.popleft())
                if len(deferred) >= rows_left:
                    break
                continue
            start = hit.num_tokens
            n = min(target - start, budget)
            end = start + n
            fresh = blocks_for_tokens(end, bs) - shared  # at least one: the chunk starts at a block boundary
            if fresh < 1 or shared + fresh > max_blocks:  # Scheduler.add refuses what the table cannot hold
                raise IntegrityError(f"{request.request_id} would hold {shared} + {fresh} blocks; 1 <= fresh and "
                                     f"the table's {max_blocks} allowed")
            if fresh + hit.num_reclaimed > available:
                self.short_of_blocks = True
                break
            waiting.popleft()
            row = free_rows.pop()
            if caching:
                prompt_tokens += target
                cached_tokens += start
                if start:
                    prefix.share(row, hit)
                if following is not None and end >= start + bs:  # ``PrefixSharer.note_computing``, inlined
                    computing.add(following)
            outputs = target - prompt_len  # a preempted request's outputs, recomputed in this prefill
            if end > prompt_len:
                self.reaches_outputs = True
            samples = end == target  # the chunk ends the prefill, and samples
            max_tokens = request.params.max_tokens
            drains = samples and outputs >= max_tokens - 1  # its only output left is scheduled now
            # The request's own side, in the same pass (nothing before ``_apply`` reads it; the arrays wait for it).
            owners[row] = request
            request.token_row = row
            running[request.arrival_seq] = request
            if drains:
                request.status = _DRAINING
                drained.append(request)
            else:
                request.status = _RUNNING
                if not samples:
                    prefilling.append(request)
            num_sampling += samples
            decodes = samples and not drains
            num_decoding += decodes
            step = outputs if samples else 0  # the sample step: outputs scheduled before this one
            prefill.append(ScheduledRow(request, row, start, n, samples, step, True, start))
            # Its tokens for the metadata writer, here where start and end are at hand: a burst's whole prompts
            # are their arrays as made on arrival.
            tokens.append(request.chunk_tokens(start, end))
            key += 1
            popped += fresh
            batch.append(request)
            records.append((row, start, n, prompt_len, step, samples, 1, start, num_tokens,
                            shared + fresh,
                            # RowState's counters (ROW_COUNTERS): num_computed (the chunk's end) and seq, the chunk
                            # table's last two columns, then admit_key, prefill_len, num_scheduled, num_outputs,
                            # token_cap, spec_over
                            end, request.arrival_seq, key, target, outputs + samples, outputs, prompt_len + max_tokens,
                            0, fresh, popped - 1, row * max_blocks + shared + fresh - popped, decodes))
            num_tokens += n
            if not self.batch:  # the one-at-a-time reference: applied as decided
                self._apply(batch, _table(records), popped, num_decoding)
                batch, records, popped, num_decoding = [], [], 0, 0
                available = blocks.num_free_blocks
                unused = blocks.num_unused_blocks
            else:
                if fresh > unused:  # the free stack runs out: the rest are evicted now, unseen by later hits
                    blocks.evict_for_admission(fresh - unused)
                    unused = 0
                else:
                    unused -= fresh
                available -= fresh + hit.num_reclaimed
            budget -= n
            rows_left -= 1
        if deferred:
            waiting.extendleft(reversed(deferred))
            blocks.prefix.stats.deferred_admissions += len(deferred)
        self.num_admissions = key
        self.num_sampling = num_sampling
        if batch:
            self._apply(batch, _table(records), popped, num_decoding)
        tables = self._tables
        if tables:
            self.table = tables[0] if len(tables) == 1 else np.concatenate(tables)
            tables.clear()
        if caching:
            prefix.count_admissions(prompt_tokens, cached_tokens)
        self.seconds += time.perf_counter() - started
        self.cpu_seconds += time.thread_time() - started_cpu
        return budget

    def _new_prompt_run(self, budget: int, rows_left: int, available: int) -> _NewPromptRun:
        """The run of waiting requests from the queue's head that ``_admit_run`` may admit as one (nothing is
        changed): new prompts that miss the cache, each whole in the budget but perhaps the last, which gets the
        budget's rest as its first chunk (``chunked``), as the general pass would give it.

        A request is in the run only where ``admit``'s general pass would admit it without a lookup, a share or a
        wait: no tokens in flight and no outputs to recompute (a new request), its first block's key neither
        cached nor computed by this plan nor repeated in the run (so it can neither hit nor wait:
        ``PrefixSharer.waits_for_computing``), more than one token to generate (it does not drain), its first
        chunk within the block table and the ``available`` blocks left. A chunked prompt in the run saves the
        general pass a second ``_apply`` in the step: the usual end of a burst's admitting step, whose budget
        leaves room for part of one more prompt."""
        blocks = self.blocks
        cached = self.prefix.cached_keys() if blocks.caching else ()
        computing = self.prefix.computing
        bs, max_blocks = blocks.block_size, self.max_blocks_per_seq
        run = _NewPromptRun([], [], set(), 0, 0, False)
        lengths, firsts = run.lengths, run.firsts
        num_tokens = num_blocks = prompt_tokens = 0
        for request in islice(self.waiting, rows_left):
            if request.num_pending or request.num_outputs or num_tokens == budget:
                break
            prompt_len = n = len(request.prompt_token_ids)
            chunked = n > budget - num_tokens  # the budget's rest: the run ends with this prompt's first chunk
            if chunked:
                n = budget - num_tokens
            fresh = -(-n // bs)
            if num_blocks + fresh > available or fresh > max_blocks or request.params.max_tokens <= 1:
                break
            keys = request.block_keys  # empty without caching, and for a prompt shorter than a block
            if keys:
                first = keys[0]
                if first in cached or first in computing or first in firsts:
                    break
                if n >= bs:  # the chunk computes its first block (a short first chunk does not)
                    firsts.add(first)
            num_tokens += n
            num_blocks += fresh
            prompt_tokens += prompt_len
            run.requests.append(request)
            lengths.append(n)
            if chunked:
                run.chunked = True
                break
        run.num_tokens, run.prompt_tokens = num_tokens, prompt_tokens
        return run

    def _admit_run(self, run: _NewPromptRun, prefill: list[ScheduledRow], key: int, offset: int) -> None:
        """Admit ``run`` (``_new_prompt_run``, the queue's head), deciding for each request what ``admit``'s
        general pass would and leaving the same state, with the per-request Python down to the statements that
        touch each ``Request``: the admission table is built with column operations, not a tuple a request.
        Everything decided before it is applied, so the block manager's free stack is current. ``key``: the last
        admission's key; ``offset``: the tokens of this plan's admissions so far. The fresh blocks the free stack
        cannot hold are evicted from the cache once for the run (``evict_for_admission``: no request of the run can
        hit, so no lookup of theirs comes between) and ``_apply`` pops them: the blocks single pops would take, in
        order."""
        requests, lengths = run.requests, run.lengths
        a = len(requests)
        waiting, free_rows, owners, running, tokens = self.waiting, self.free_rows, self.owners, self.running, \
            self.tokens
        rows = free_rows[:-a - 1:-1]  # the rows single pops take, in order
        del free_rows[-a:]
        for request, row, n in zip(requests, rows, lengths):
            waiting.popleft()
            owners[row] = request
            request.token_row = row
            request.status = _RUNNING
            running[request.arrival_seq] = request
            prefill.append(ScheduledRow(request, row, 0, n, True, 0, True, 0))
            tokens.append(request.prompt_array)  # ``chunk_tokens(0, n)`` of a whole prompt
        if run.chunked:  # the last one's first chunk: it samples nothing yet, and goes on prefilling
            request, n = requests[-1], lengths[-1]
            prefill[-1] = ScheduledRow(request, rows[-1], 0, n, False, 0, True, 0)
            tokens[-1] = request.chunk_tokens(0, n)
            self.prefilling.append(request)
        self.prefix.computing.update(run.firsts)  # ``note_computing`` of each, as the general pass does
        # The admission table (``admit``'s columns): whole prompts, nothing cached, sampling at step 0, decoding after
        # (a chunked last one's row is corrected below).
        bs = self.blocks.block_size
        lens = np.array(lengths, dtype=np.int64)  # [A]
        row_ids = np.array(rows, dtype=np.int64)  # [A]
        fresh = -(-lens // bs)  # [A]
        popped = np.cumsum(fresh)  # [A] the run's fresh blocks up to each one's last
        table = np.empty((a, _TABLE_WIDTH), dtype=np.int64)  # [A, _TABLE_WIDTH]
        table[:] = _RUN_CONSTANTS  # the columns equal for every request of a run; the rest are set below
        table[:, CHUNK_ROW] = row_ids
        table[:, CHUNK_N] = table[:, CHUNK_PROMPT] = table[:, CHUNK_END] = table[:, _PREFILL_LEN] = lens
        table[:, CHUNK_OFFSET] = np.cumsum(lens) + (offset - lens)
        table[:, CHUNK_BLOCKS] = table[:, _FRESH] = fresh
        table[:, CHUNK_SEQ] = np.fromiter((r.arrival_seq for r in requests), dtype=np.int64, count=a)
        table[:, _ADMIT_KEY] = np.arange(key + 1, key + a + 1, dtype=np.int64)
        table[:, _TOKEN_CAP] = lens + np.fromiter((r.params.max_tokens for r in requests), dtype=np.int64, count=a)
        table[:, _LAST] = popped - 1
        table[:, _FLAT] = row_ids * self.max_blocks_per_seq + fresh - popped
        if run.chunked:  # scalar writes: a fancy index costs more than these six
            request, last = requests[-1], table[-1]
            last[CHUNK_PROMPT] = last[_PREFILL_LEN] = prompt_len = len(request.prompt_token_ids)
            last[CHUNK_SAMPLES] = last[_SCHEDULED] = last[_DECODES] = 0
            last[_TOKEN_CAP] = prompt_len + request.params.max_tokens
        total, unused = int(popped[-1]), self.blocks.num_unused_blocks
        if total > unused:
            self.blocks.evict_for_admission(total - unused)
        self._apply(requests, table, total, a - run.chunked)

    def _apply(self, requests: list[Request], table: np.ndarray, popped: int, num_decoding: int) -> None:
        """Rows and blocks of the decided admissions ``requests`` (in queue order), with their admission table
        ``table`` (``[A, _TABLE_WIDTH]``, ``admit``'s columns: a row each), the fresh blocks they take (``popped``)
        and how many of them decode after this step (``num_decoding``): the array side of admitting them, a few
        operations whatever their number (``admit`` did each one's Python side as it decided it)."""
        a = len(requests)
        rows = table[:, CHUNK_ROW]  # [A]
        self.blocks.allocate_admitted(rows, table[:, _FRESH], table[:, CHUNK_BLOCKS], table[:, _LAST], table[:, _FLAT],
                                      popped)
        decodes = table[:, _DECODES]  # [A]
        self.rows.admit_many(rows, requests, table[:, _COUNTERS], decodes)
        if num_decoding == a:  # the usual burst: every prompt fits its first chunk
            self.decode.add_many(rows, table[:, _ADMIT_KEY])
        elif num_decoding:
            completed = decodes != 0  # [A]
            self.decode.add_many(rows[completed], table[completed, _ADMIT_KEY])
        self.prefix.note_prefills(requests)
        self._tables.append(table[:, :CHUNK_COLUMNS])  # [A, CHUNK_COLUMNS] the chunk table


def _table(records: list[tuple[int, ...]]) -> np.ndarray:
    """``admit``'s records (``_TABLE_WIDTH`` ints per admission) as the admission table ``[A, _TABLE_WIDTH]``."""
    a = len(records)
    return np.fromiter(chain.from_iterable(records), dtype=np.int64, count=_TABLE_WIDTH * a).reshape(a, _TABLE_WIDTH)


@dataclass(slots=True)
class _NewPromptRun:
    """Waiting requests from the queue's head that ``Admitter._admit_run`` admits as one (``_new_prompt_run``)."""

    requests: list[Request]
    lengths: list[int]  # their first chunks' lengths: each one's whole prompt, but a ``chunked`` last one's
    firsts: set[int]  # the first block keys their first chunks compute (each full first block)
    num_tokens: int  # the sum of ``lengths``
    prompt_tokens: int  # the sum of their prompts' lengths
    chunked: bool  # the last one's first chunk is part of its prompt (it samples nothing yet)
