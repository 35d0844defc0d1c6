"""Writes a ``StepPlan`` into a staging buffer: the planner's half of the handoff.

Per-request constants (sampling parameters, block table rows) live in
persistent arrays indexed by token row, refreshed only when a row changes
owner or a request gains blocks; each step then gathers them with numpy fancy
indexing instead of a Python loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncbatch.engine.host_staging import StagingBuffer
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import StepPlan


@dataclass(slots=True)
class PrefillRowMeta:
    token_start: int
    q_len: int
    ctx_len: int
    token_row: int
    block_count: int


@dataclass(slots=True)
class StepMeta:
    """Host-side header of a written staging buffer: sizes and per-step flags."""

    step_id: int
    staging: StagingBuffer
    num_tokens: int
    num_decode: int
    decode_max_blocks: int
    prefill_rows: list[PrefillRowMeta]
    num_sampled: int
    context_tokens: int  # total context attended over, for cost models
    all_greedy: bool
    any_filter: bool  # some row uses top-k, top-p or min-p
    any_penalty: bool
    first_chunk_rows: list[int]  # token rows whose request (re)starts its prefill in this step


class StepMetadataWriter:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        s = max_num_seqs
        self._owner: list[Request | None] = [None] * s
        self._generation = np.zeros(s, dtype=np.int64)  # owner's preemption count: a resumed request is new
        self._blocks_known = np.zeros(s, dtype=np.int64)
        self.block_table = np.zeros((s, max_blocks_per_seq), dtype=np.int64)
        self._seed = np.zeros(s, dtype=np.int64)
        self._top_k = np.zeros(s, dtype=np.int64)
        self._temperature = np.zeros(s, dtype=np.float32)
        self._top_p = np.ones(s, dtype=np.float32)
        self._min_p = np.zeros(s, dtype=np.float32)
        self._presence = np.zeros(s, dtype=np.float32)
        self._frequency = np.zeros(s, dtype=np.float32)
        self._repetition = np.ones(s, dtype=np.float32)
        self._uses_penalty = np.zeros(s, dtype=bool)

    def _refresh(self, request: Request) -> int:
        row = request.token_row
        assert row is not None, "a scheduled request holds a token row"
        if self._owner[row] is not request or self._generation[row] != request.num_preemptions:
            self._owner[row] = request
            self._generation[row] = request.num_preemptions
            self._blocks_known[row] = 0
            p = request.params
            self._seed[row] = request.seed
            self._top_k[row] = max(p.top_k, 0)
            self._temperature[row] = p.temperature
            self._top_p[row] = p.top_p
            self._min_p[row] = p.min_p
            self._presence[row] = p.presence_penalty
            self._frequency[row] = p.frequency_penalty
            self._repetition[row] = p.repetition_penalty
            self._uses_penalty[row] = p.uses_penalties
        blocks = request.block_ids
        known = int(self._blocks_known[row])
        if known != len(blocks):
            self.block_table[row, known:len(blocks)] = blocks[known:]
            self._blocks_known[row] = len(blocks)
        return row

    def write(self, plan: StepPlan, staging: StagingBuffer) -> StepMeta:
        bs = self.block_size
        nd = plan.num_decode
        decode = plan.rows[:nd]
        sample_rows: list[int] = []
        sample_steps: list[int] = []
        logits_idx: list[int] = []
        context_tokens = 0
        max_blocks_used = 0

        if nd:
            rows = np.fromiter((self._refresh(r.request) for r in decode), dtype=np.int64, count=nd)
            pos = np.fromiter((r.start for r in decode), dtype=np.int64, count=nd)
            nblocks = pos // bs + 1
            max_blocks_used = int(nblocks.max())
            staging.positions[:nd] = pos
            staging.slot_mapping[:nd] = self.block_table[rows, pos // bs] * bs + pos % bs
            staging.token_is_output[:nd] = True
            staging.token_owner_row[:nd] = rows
            staging.decode_token_rows[:nd] = rows
            staging.decode_block_tables[:nd, :max_blocks_used] = self.block_table[rows, :max_blocks_used]
            staging.decode_context_lens[:nd] = pos + 1
            context_tokens += int(pos.sum()) + nd
            sample_rows.extend(rows.tolist())
            sample_steps.extend(r.request.num_scheduled_outputs - 1 for r in decode)
            logits_idx.extend(range(nd))

        prefill_meta: list[PrefillRowMeta] = []
        first_chunks: list[int] = []
        t = nd
        for row_index, row in enumerate(plan.rows[nd:]):
            request = row.request
            ts = self._refresh(request)
            n, start = row.num_tokens, row.start
            end = start + n
            prompt_len = len(request.prompt_token_ids)
            tokens = request.prompt_token_ids[start:end] if end <= prompt_len else request.all_token_ids()[start:end]
            pos = np.arange(start, end, dtype=np.int64)
            staging.input_ids[t:t + n] = tokens
            staging.positions[t:t + n] = pos
            staging.slot_mapping[t:t + n] = self.block_table[ts, pos // bs] * bs + pos % bs
            staging.token_is_output[t:t + n] = pos >= prompt_len
            staging.token_owner_row[t:t + n] = ts
            nb = -(-end // bs)
            staging.prefill_block_tables[row_index, :nb] = self.block_table[ts, :nb]
            prefill_meta.append(PrefillRowMeta(t, n, end, ts, nb))
            staging.prefill_row_spans[row_index] = (t, n, end)
            if start == 0:
                staging.first_chunk_token_rows[len(first_chunks)] = ts
                first_chunks.append(ts)
            context_tokens += end
            if row.samples:
                sample_rows.append(ts)
                sample_steps.append(request.num_scheduled_outputs - 1)
                logits_idx.append(t + n - 1)
            t += n

        r = len(sample_rows)
        ss = np.asarray(sample_rows, dtype=np.int64)
        staging.logits_indices[:r] = logits_idx
        staging.sample_token_rows[:r] = ss
        staging.sample_step[:r] = sample_steps
        staging.sample_seed[:r] = self._seed[ss]
        top_k = self._top_k[ss]
        staging.sample_top_k[:r] = top_k
        temps = self._temperature[ss]
        staging.sample_temperature[:r] = temps
        top_p, min_p = self._top_p[ss], self._min_p[ss]
        staging.sample_top_p[:r] = top_p
        staging.sample_min_p[:r] = min_p
        staging.sample_presence[:r] = self._presence[ss]
        staging.sample_frequency[:r] = self._frequency[ss]
        staging.sample_repetition[:r] = self._repetition[ss]
        random_rows = temps > 0
        return StepMeta(
            step_id=plan.step_id,
            staging=staging,
            num_tokens=t,
            num_decode=nd,
            decode_max_blocks=max_blocks_used,
            prefill_rows=prefill_meta,
            num_sampled=r,
            context_tokens=context_tokens,
            all_greedy=not bool(random_rows.any()),
            any_filter=bool((random_rows & ((top_k > 0) | (top_p < 1) | (min_p > 0))).any()),
            # Non-sampling prefill chunks of a penalised request must still feed its penalty state.
            any_penalty=bool(self._uses_penalty[ss].any()) or any(self._uses_penalty[p.token_row]
                                                                  for p in prefill_meta),
            first_chunk_rows=first_chunks,
        )
