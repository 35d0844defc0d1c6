"""The prefill half of a step's metadata: every prefill chunk of a plan written with a few array operations.

``StepMetadataWriter`` writes the decode rows ``[:num_decode]`` of a staging
buffer; this module writes the prefill chunks after them. A burst of
admissions is hundreds of chunks in one plan, so the per-chunk work is one
Python pass that reads each ``ScheduledRow`` once (its token row, span and
flags into a tuple, its tokens into one flat list); positions, slot
mappings, owner rows, output flags, block tables and row spans are then
computed for all chunks at once. Only the rare penalised chunk that reuses
cached blocks goes through Python again (``CachedContext``).

Columns of ``prefill_block_tables`` past a chunk's block count receive stale
ids of the block table (the widest chunk sets how many are copied); readers
are bounded by each chunk's ``block_count`` and context length, as for the
block table itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.row_state import NO_ROWS, RowState
from asyncbatch.engine.step_contract import CachedContext, PrefillRowMeta, StagingBuffer
from asyncbatch.engine.step_plan import StepPlan

# Columns of the per-chunk table read from the plan (one row per ScheduledRow).
_ROW, _START, _N, _PROMPT, _STEP, _SAMPLES, _FIRST, _CACHED = range(8)


class PrefillWrite(NamedTuple):
    """What the prefill chunks add to a ``StepMeta`` (sampled rows in plan order, after the decode rows)."""

    num_tokens: int
    context_tokens: int
    any_penalty: bool
    meta: list[PrefillRowMeta]
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
    tokens: list[int] = []
    spec = []
    for row in plan.prefill:  # the one Python pass per chunk
        request, start, n = row.request, row.start, row.num_tokens
        prompt = request.prompt_token_ids
        end = start + n
        tokens += prompt[start:end] if end <= len(prompt) else request.all_token_ids()[start:end]
        spec.append((row.token_row, start, n, len(prompt), row.sample_step, row.samples, row.first, row.num_cached))
    c = np.array(spec, dtype=np.int64)  # [P, 8]
    token_rows, starts, ns = c[:, _ROW], c[:, _START], c[:, _N]  # [P]
    ends = starts + ns  # [P]
    token_starts = nd + np.cumsum(ns) - ns  # [P] each chunk's first index in the step's tokens
    total = len(tokens)
    t = nd + total
    owner = np.repeat(token_rows, ns)  # [T]
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - (token_starts - nd), ns)  # [T]
    staging.input_ids[nd:t] = tokens
    staging.positions[nd:t] = pos
    staging.slot_mapping[nd:t] = table[owner, pos // bs] * bs + pos % bs
    staging.token_is_output[nd:t] = pos >= np.repeat(c[:, _PROMPT], ns)
    staging.token_owner_row[nd:t] = owner
    block_counts = (ends + bs - 1) // bs  # [P]
    p = len(c)
    widest = int(block_counts.max())
    staging.prefill_block_tables[:p, :widest] = table[token_rows, :widest]
    spans = staging.prefill_row_spans[:p]  # [P, 3]
    spans[:, 0], spans[:, 1], spans[:, 2] = token_starts, ns, ends
    meta = list(map(PrefillRowMeta, token_starts.tolist(), ns.tolist(), ends.tolist(), token_rows.tolist(),
                    block_counts.tolist()))
    first = token_rows[c[:, _FIRST] != 0]  # [F]
    staging.first_chunk_token_rows[:len(first)] = first
    penalised = rows.uses_penalty[token_rows]  # [P]
    # Non-sampling chunks of a penalised request must still feed its penalty state; a reused cached prefix
    # is not computed, so its tokens travel in the CachedContext.
    reused = (penalised & (c[:, _CACHED] > 0)).nonzero()[0]
    samples = c[:, _SAMPLES] != 0  # [P]
    cached = (c[:, _CACHED] > 0).nonzero()[0] if history else NO_ROWS
    return PrefillWrite(total, int(ends.sum()), bool(penalised.any()), meta, first.tolist(),
                        _cached_context(plan, reused.tolist()) if len(reused) else None,
                        _cached_context(plan, cached.tolist()) if len(cached) else None, token_rows[samples],
                        c[samples, _STEP], (token_starts + ns - 1)[samples])


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
