"""Writes a ``StepPlan`` into a staging buffer: the planner's half of the handoff.

Everything per request comes from arrays indexed by token row: the block
table (``BlockManager.block_table``, written where blocks are allocated) and
the sampling constants (``RowState``). The decode part is numpy over the
plan's row arrays; only prefill chunks go through Python.

A staging buffer is reused every other step. When its decode part was last
written for the same decode rows (``StepPlan.decode_version``), the arrays that
depend only on which rows decode (token rows, sampling constants, owner rows,
output flags, logits indices) are still right and are not rewritten, and of
the block tables only the entries added since are copied (one per row that
crossed a block boundary in a plan since). This relies on one invariant:
nothing but this writer writes a buffer's first ``num_decode`` rows (prefill
chunks start after them, CUDA graph padding writes only past them). Block
table columns past a row's last block may hold stale ids; readers are bounded
by the context length.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from asyncbatch.engine.block_manager import BlockManager, IntegrityError
from asyncbatch.engine.prefill_metadata import NO_PREFILL, write_prefill
from asyncbatch.engine.row_state import RowState
from asyncbatch.engine.step_contract import CachedContext, PrefillRowMeta, StagingBuffer, StepMeta
from asyncbatch.engine.step_extras import StepExtrasWriter
from asyncbatch.engine.step_plan import StepPlan

__all__ = ["CachedContext", "PrefillRowMeta", "StepMeta", "StepMetadataWriter"]  # the data: step_contract

_RECENT_PLANS = 4  # block additions remembered for buffers last written up to this many plans ago


@dataclass(slots=True)
class _DecodeFlags:
    """Sampling flags of one decode row set (one ``decode_version``)."""

    version: int
    any_random: bool
    any_filter: bool
    any_penalty: bool


class StepMetadataWriter:
    """Fills staging buffers from plans of one scheduler; every plan must be written, in order."""

    def __init__(self, rows: RowState, blocks: BlockManager, extras: StepExtrasWriter | None = None,
                 speculative: bool = False) -> None:
        self.rows = rows
        self.speculative = speculative  # list reused cached prefixes for the device's token history
        self.extras = extras
        self.blocks = blocks
        self.block_size = blocks.block_size
        self._arange = np.arange(max(blocks.max_num_seqs, 1), dtype=np.int64)
        # id(staging) -> (staging, decode_version, step_id) of its last write; holding the buffer keeps its id.
        self._written: dict[int, tuple[StagingBuffer, int, int]] = {}
        # (step_id, decode_version, grown rows [G], the block column each was given [G]) of recent plans.
        self._recent: deque[tuple[int, int, np.ndarray, np.ndarray]] = deque(maxlen=_RECENT_PLANS)
        self._flags = _DecodeFlags(-1, False, False, False)

    def write(self, plan: StepPlan, staging: StagingBuffer) -> StepMeta:
        st = self.rows
        nd = plan.num_decode
        grew = plan.decode_grew
        self._recent.append((plan.step_id, plan.decode_version, grew,
                             plan.decode_positions[grew] // self.block_size if len(grew) else grew))
        max_blocks_used = 0
        context_tokens = 0
        any_random = any_filter = any_penalty = False
        if nd:
            max_blocks_used = self._write_decode(plan, staging)
            context_tokens = int(plan.decode_positions.sum()) + nd
            flags = self._decode_flags(plan)
            any_random, any_filter, any_penalty = flags.any_random, flags.any_filter, flags.any_penalty
            self._written[id(staging)] = (staging, plan.decode_version, plan.step_id)
        else:
            self._written.pop(id(staging), None)

        prefill = NO_PREFILL
        if plan.prefill:
            prefill_start, prefill_cpu = time.perf_counter(), time.thread_time()
            prefill = write_prefill(plan, staging, st, self.blocks, self.speculative)
            if plan.num_admitted:  # the staging writes of an admission step count as admission cost
                plan.admit_s += time.perf_counter() - prefill_start
                plan.admit_cpu_s += time.thread_time() - prefill_cpu
        t = plan.num_decode_tokens + prefill.num_tokens
        context_tokens += prefill.context_tokens
        any_penalty = any_penalty or prefill.any_penalty
        ss = prefill.sample_rows  # [P] token rows of the prefill rows that sample, plan order
        r = nd + len(ss)
        if len(ss):
            staging.logits_indices[nd:r] = prefill.logits_indices
            staging.sample_token_rows[nd:r] = ss
            staging.sample_step[nd:r] = prefill.sample_steps
            self._write_sampling_constants(staging, nd, r, ss)
            # The greedy and filter flags from what was just gathered into the staging buffer, not gathered again.
            random_rows = staging.sample_temperature[nd:r] > 0  # [P]
            any_random = any_random or bool(random_rows.any())
            any_filter = any_filter or bool((random_rows & ((staging.sample_top_k[nd:r] > 0)
                                                            | (staging.sample_top_p[nd:r] < 1)
                                                            | (staging.sample_min_p[nd:r] > 0))).any())
        return StepMeta(
            step_id=plan.step_id,
            staging=staging,
            num_tokens=t,
            num_decode=nd,
            decode_max_blocks=max_blocks_used,
            prefill_rows=prefill.meta,
            num_sampled=r,
            context_tokens=context_tokens,
            all_greedy=not any_random,
            any_filter=any_filter,
            any_penalty=any_penalty,
            first_chunk_rows=prefill.first_chunk_rows,
            cached_context=prefill.cached_context,
            spec_depth=plan.spec_depth,
            history_context=prefill.history_context,
            extras=None if self.extras is None else self.extras.build(
                plan, np.concatenate([plan.decode_rows, ss]) if len(ss) else plan.decode_rows, staging.sample_step[:r]),
        )

    def check_decode_tables(self, meta: StepMeta) -> None:
        """``IntegrityError`` unless the staged block table of every decode row equals the row's table in every
        column the device reads (``decode_max_blocks``): the staging buffer is patched, not rewritten, between
        plans of one decode set (``debug_check_integrity`` runs this after every write)."""
        nd, width = meta.num_decode, meta.decode_max_blocks
        if not nd:
            return
        rows = meta.staging.decode_token_rows[:nd]
        staged = meta.staging.decode_block_tables[:nd, :width]
        held = self.blocks.block_table[rows, :width]
        needed = np.arange(width)[None, :] < self.blocks.num_row_blocks[rows][:, None]  # [D, W] columns held
        wrong = np.argwhere(needed & (staged != held))
        if len(wrong):
            i, column = (int(x) for x in wrong[0])
            raise IntegrityError(f"step {meta.step_id}: decode row {int(rows[i])}'s staged block table has block "
                                 f"{int(staged[i, column])} in column {column}; the row holds {int(held[i, column])}")

    def _write_decode(self, plan: StepPlan, staging: StagingBuffer) -> int:
        """Decode rows ``[:nd]`` of every per-token and per-sample array; returns the widest block count."""
        nd = plan.num_decode
        rows, pos = plan.decode_rows, plan.decode_positions  # [D]
        staging.positions[:nd] = pos
        # The input token lies in the row's newest block (the scheduler allocated it).
        np.add(self.blocks.decode_slot_base[rows], pos, out=staging.slot_mapping[:nd])
        np.add(pos, 1, out=staging.decode_context_lens[:nd])
        staging.sample_step[:nd] = plan.decode_steps
        max_blocks = int(pos.max()) // self.block_size + 1
        grown = self._blocks_since_last_write(plan, staging)
        if grown is None:
            staging.token_is_output[:nd] = True
            staging.token_owner_row[:nd] = rows
            staging.decode_token_rows[:nd] = rows
            staging.sample_token_rows[:nd] = rows
            staging.logits_indices[:nd] = self._arange[:nd]
            # Every block the rows hold, not only those this plan's positions reach: a speculative row keeps the
            # blocks it reserved for drafts that were rejected, and a later plan of the same decode set reaches
            # into them without growing, so nothing would patch them here (``grown`` lists new blocks only).
            held = int(self.blocks.num_row_blocks[rows].max())
            staging.decode_block_tables[:nd, :held] = self.blocks.block_table[rows, :held]
            self._write_sampling_constants(staging, 0, nd, rows)
        else:  # the buffer holds these rows' tables but for the blocks added since
            for index, column in grown:
                staging.decode_block_tables[index, column] = self.blocks.block_table[rows[index], column]
        return max_blocks

    def _blocks_since_last_write(self, plan: StepPlan,
                                 staging: StagingBuffer) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """(decode row indices, block columns) given since ``staging`` last held these rows, one pair per plan
        since; None when the buffer must be rewritten."""
        last = self._written.get(id(staging))
        if last is None or last[0] is not staging or last[1] != plan.decode_version:
            return None
        since = [(version, grew, columns) for step, version, grew, columns in self._recent if step > last[2]]
        if len(since) != plan.step_id - last[2] or any(version != plan.decode_version for version, _, _ in since):
            return None  # a plan in between is not on record, or decoded other rows
        return [(grew, columns) for _, grew, columns in since if len(grew)]

    def _write_sampling_constants(self, staging: StagingBuffer, lo: int, hi: int, rows: np.ndarray) -> None:
        st = self.rows
        staging.sample_seed[lo:hi] = st.seed[rows]
        staging.sample_top_k[lo:hi] = st.top_k[rows]
        staging.sample_temperature[lo:hi] = st.temperature[rows]
        staging.sample_top_p[lo:hi] = st.top_p[rows]
        staging.sample_min_p[lo:hi] = st.min_p[rows]
        staging.sample_presence[lo:hi] = st.presence[rows]
        staging.sample_frequency[lo:hi] = st.frequency[rows]
        staging.sample_repetition[lo:hi] = st.repetition[rows]

    def _decode_flags(self, plan: StepPlan) -> _DecodeFlags:
        if self._flags.version != plan.decode_version:
            st, rows = self.rows, plan.decode_rows
            random_rows = st.temperature[rows] > 0  # [D]
            any_filter = random_rows & ((st.top_k[rows] > 0) | (st.top_p[rows] < 1) | (st.min_p[rows] > 0))
            self._flags = _DecodeFlags(plan.decode_version, bool(random_rows.any()), bool(any_filter.any()),
                                       bool(st.uses_penalty[rows].any()))
        return self._flags

