"""The prefill half of a step's metadata: every prefill chunk of a plan written with a few array operations.

``StepMetadataWriter`` writes the decode rows ``[:num_decode]`` of a staging
buffer; this module writes the prefill chunks after them. A burst of
admissions is hundreds of chunks in one plan, so no step here is per chunk
for them: the scheduler hands over the admitted chunks' table
(``StepPlan.admitted``, with each chunk's token offset, end and block count
worked out in the Python pass that admitted it), their tokens are the
requests' prompt arrays (made on arrival; a view for part of one), listed by
that same pass (``StepPlan.admitted_tokens``) and joined into the staging
buffer by one concatenate, and the rows' metadata stays an array (``PrefillRows``).
The chunks of running prefills (a few per step) take one Python pass that
reads each ``ScheduledRow`` once. Positions, slot mappings, owner rows,
output flags, block tables and row spans are computed for all chunks at
once. Only the rare penalised chunk that reuses cached
blocks goes through Python again (``CachedContext``).

Columns of ``prefill_block_tables`` past a chunk's block count receive stale
ids of the block table (the widest chunk sets how many are copied); readers
are bounded by each chunk's ``block_count`` and context length, as for the
block table itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.row_state import NO_ROWS, RowState
from asyncbatch.engine.step_contract import CachedContext, PrefillRowMeta, PrefillRows, StagingBuffer
from asyncbatch.engine.step_plan import (
    CHUNK_BLOCKS,
    CHUNK_CACHED,
    CHUNK_END,
    CHUNK_N,
    CHUNK_OFFSET,
    CHUNK_PROMPT,
    CHUNK_ROW,
    CHUNK_START,
    CHUNK_STEP,
    StepPlan,
    sampling_chunks,
)

# The chunk table's columns that make a ``PrefillRows`` row (``PrefillRowMeta``: token start, count, end, token row,
# block count), in that order.
_ROW_META = np.array([CHUNK_OFFSET, CHUNK_N, CHUNK_END, CHUNK_ROW, CHUNK_BLOCKS])


class PrefillWrite(NamedTuple):
    """What the prefill chunks add to a ``StepMeta`` (sampled rows in plan order, after the decode rows)."""

    num_tokens: int
    context_tokens: int
    any_penalty: bool
    meta: Sequence[PrefillRowMeta]  # a PrefillRows ([] for none)
    first_chunk_rows: list[int]
    cached_context: CachedContext | None
    history_context: CachedContext | None  # every first chunk's reused prefix (speculative engines only)
    sample_rows: np.ndarray  # [P] int64 token rows of the chunks that sample
    sample_steps: np.ndarray  # [P] int64 their sample steps
    logits_indices: np.ndarray  # [P] int64 index of each one's last token in the step


NO_PREFILL = PrefillWrite(0, 0, False, [], [], None, None, NO_ROWS, NO_ROWS, NO_ROWS)


def write_prefill(plan: StepPlan, staging: StagingBuffer, rows: RowState, blocks: BlockManager,
                  history: bool = False) -> PrefillWrite:
    """Write ``plan.prefill`` into ``staging`` after its decode tokens (``plan.num_decode_tokens``).
    ``history``: also list every reused cached prefix (``PrefillWrite.history_context``)."""
    nd, bs, table = plan.num_decode_tokens, blocks.block_size, blocks.block_table
    admitted = plan.admitted  # the admitted chunks' table, made by the scheduler: the last A chunks
    running = plan.prefill[:len(plan.prefill) - len(admitted)] if admitted is not None else plan.prefill
    parts: list[np.ndarray] = []  # each chunk's tokens
    spec = []
    offset = 0
    reach_outputs = plan.admitted_reach_outputs  # some chunk's end passes its prompt (a recompute's outputs)
    for row in running:  # the one Python pass per chunk of a running prefill
        request, start, n = row.request, row.start, row.num_tokens
        prompt_len = len(request.prompt_token_ids)
        parts.append(request.chunk_tokens(start, start + n))
        spec.append((row.token_row, start, n, prompt_len, row.sample_step, row.samples, row.first,
                     row.num_cached, offset, blocks.blocks_for(start + n), start + n, request.arrival_seq))
        reach_outputs = reach_outputs or start + n > prompt_len
        offset += n
    if admitted is None:
        c = np.array(spec, dtype=np.int64)  # [P, CHUNK_COLUMNS]
    else:
        c = admitted
        if spec:
            c = np.concatenate([np.array(spec, dtype=np.int64), c])
            c[len(spec):, CHUNK_OFFSET] += offset  # the admitted chunks' tokens come after the running ones'
        parts += plan.admitted_tokens  # the admitted chunks' tokens, listed by the admission loop
    token_rows, starts, ns, ends = c[:, CHUNK_ROW], c[:, CHUNK_START], c[:, CHUNK_N], c[:, CHUNK_END]  # [P]
    offsets = c[:, CHUNK_OFFSET]  # [P] each chunk's first index among the step's prefill tokens
    total = int(c[-1, CHUNK_OFFSET] + c[-1, CHUNK_N])
    t = nd + total
    owner = np.repeat(token_rows, ns)  # [T]
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - offsets, ns)  # [T]
    np.concatenate(parts, out=staging.input_ids[nd:t])
    staging.positions[nd:t] = pos
    staging.slot_mapping[nd:t] = _slots(table, owner, pos, bs)
    if reach_outputs:  # a recompute after a preemption reaches its outputs
        staging.token_is_output[nd:t] = pos >= np.repeat(c[:, CHUNK_PROMPT], ns)
    else:
        staging.token_is_output[nd:t] = False
    staging.token_owner_row[nd:t] = owner
    block_counts = c[:, CHUNK_BLOCKS]  # [P]
    p = len(c)
    widest = int(block_counts.max())
    staging.prefill_block_tables[:p, :widest] = table[token_rows, :widest]
    columns = c[:, _ROW_META]  # [P, 5] in PrefillRowMeta's order, the token start still among the prefill tokens
    columns[:, 0] += nd
    token_starts = columns[:, 0]  # [P] each chunk's first index in the step's tokens
    meta = PrefillRows(columns)
    staging.prefill_row_spans[:p] = columns[:, :3]  # [P, 3] token start, count, end
    first = token_rows[len(spec):]  # [F] the admitted chunks: the first ones since (re)admission, and only they
    staging.first_chunk_token_rows[:len(first)] = first
    penalised = rows.uses_penalty[token_rows]  # [P]
    any_penalty = bool(penalised.any())
    # Non-sampling chunks of a penalised request must still feed its penalty state; a reused cached prefix
    # is not computed, so its tokens travel in the CachedContext.
    reused = (penalised & (c[:, CHUNK_CACHED] > 0)).nonzero()[0] if any_penalty else NO_ROWS
    sample_rows, sample_steps, logits_indices = token_rows, c[:, CHUNK_STEP], token_starts + ns - 1  # [P]
    samples = sampling_chunks(c, len(plan.sample_rows) - plan.num_decode)  # the plan lists the chunks that sample
    sample_rows, sample_steps, logits_indices = sample_rows[samples], sample_steps[samples], logits_indices[samples]
    cached = (c[:, CHUNK_CACHED] > 0).nonzero()[0] if history else NO_ROWS
    return PrefillWrite(total, int(ends.sum()), any_penalty, meta, first.tolist(),
                        _cached_context(plan, reused.tolist()) if len(reused) else None,
                        _cached_context(plan, cached.tolist()) if len(cached) else None, sample_rows, sample_steps,
                        logits_indices)


def _slots(table: np.ndarray, owner: np.ndarray, pos: np.ndarray, bs: int) -> np.ndarray:
    """The KV slot of each token: its owner row's block at ``pos`` (``table``: the ``[S, B]`` block table)."""
    if bs & (bs - 1):  # not a power of two
        return table[owner, pos // bs] * bs + pos % bs
    # One flat gather with shifts: a third of the 2-D gather with division's time for a burst's 8,192 tokens.
    shift = bs.bit_length() - 1
    return table.ravel()[owner * table.shape[1] + (pos >> shift)] * bs + (pos & (bs - 1))


def _cached_context(plan: StepPlan, indices: list[int]) -> CachedContext:
    parts = []
    for i in indices:
        row = plan.prefill[i]
        request, start = row.request, row.start
        prompt_len = len(request.prompt_token_ids)
        reused = request.prompt_token_ids[:start] if start <= prompt_len else request.all_token_ids()[:start]
        parts.append((row.token_row, reused, prompt_len))
    owners = np.concatenate([np.full(len(tokens), row, dtype=np.int64) for row, tokens, _ in parts])
    ids = np.concatenate([np.asarray(tokens, dtype=np.int64) for _, tokens, _ in parts])
    positions = np.concatenate([np.arange(len(tokens), dtype=np.int64) for _, tokens, _ in parts])
    return CachedContext(owners, ids, positions >= np.repeat([p for _, _, p in parts], [len(t) for _, t, _ in parts]),
                         positions)
