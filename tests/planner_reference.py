"""The per-request planner of commit 8a388b8, kept as the reference the array planner must match.

One Python object per request and per scheduled row: ``RefRequest`` holds its
own counters, outputs and block list; ``RefScheduler.schedule`` returns rows,
``RefScheduler.apply`` loops over them, and ``RefWriter`` refreshes
per-request constants row by row. Only what the comparison needs is kept (no
integrity check); the logic is the old code's, line for line where it matters.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from asyncbatch.engine.host_staging import StagingBuffer
from asyncbatch.engine.messages import AppliedStep, Finish
from asyncbatch.engine.request import RequestStatus
from asyncbatch.sampling_params import SamplingParams

DUMMY_BLOCK = 0


@dataclass(slots=True, eq=False)
class RefRequest:
    arrival_seq: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    num_pending: int = 0
    num_computed_tokens: int = 0
    prefill_len: int = 0
    token_row: int | None = None
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_preemptions: int = 0

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending

    @property
    def num_scheduled_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_pending


class RefBlocks:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_list: list[int] = list(range(num_blocks - 1, DUMMY_BLOCK, -1))

    def extra_blocks_needed(self, request: RefRequest, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(request.block_ids))

    def allocate(self, request: RefRequest, num_tokens: int) -> None:
        need = self.extra_blocks_needed(request, num_tokens)
        request.block_ids.extend(self.free_list.pop() for _ in range(need))

    def free(self, request: RefRequest) -> None:
        self.free_list.extend(reversed(request.block_ids))
        request.block_ids = []


@dataclass(slots=True)
class RefRow:
    request: RefRequest
    start: int
    num_tokens: int
    samples: bool
    is_decode: bool


@dataclass(slots=True)
class RefPlan:
    step_id: int
    rows: list[RefRow]
    num_decode: int
    num_tokens: int
    preempted: list[RefRequest]
    drained: list[RefRequest]


class RefScheduler:
    def __init__(self, blocks: RefBlocks, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[RefRequest] = deque()
        self.running: list[RefRequest] = []
        self.free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.step_id = 0
        self.num_preemptions = 0

    def schedule(self) -> RefPlan | None:
        budget = self.max_num_batched_tokens
        decode_rows: list[RefRow] = []
        prefill_rows: list[RefRow] = []
        scheduled: set[int] = set()
        preempted: list[RefRequest] = []
        prefilling: list[RefRequest] = []
        bs = self.blocks.block_size
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens < request.prefill_len:
                prefilling.append(request)
                continue
            end = request.num_computed_tokens + 1
            if end > len(request.block_ids) * bs and not self._reserve(request, end, scheduled, preempted):
                continue
            decode_rows.append(self._advance(request, 1, True))
            scheduled.add(id(request))
        budget -= len(decode_rows)
        for request in prefilling:
            if request.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            n = min(request.prefill_len - request.num_computed_tokens, budget)
            if not self._reserve(request, request.num_computed_tokens + n, scheduled, preempted):
                continue
            prefill_rows.append(self._advance(request, n, False))
            scheduled.add(id(request))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:
                break
            target = request.num_known_tokens
            n = min(target, budget)
            if self.blocks.extra_blocks_needed(request, n) > len(self.blocks.free_list):
                break
            self.waiting.popleft()
            request.prefill_len = target
            request.num_computed_tokens = 0
            request.token_row = self.free_rows.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.blocks.allocate(request, n)
            prefill_rows.append(self._advance(request, n, False))
            budget -= n
        rows = decode_rows + prefill_rows
        drained = [row.request for row in rows if row.request.status is RequestStatus.DRAINING]
        if drained:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if not rows:
            return None
        self.step_id += 1
        return RefPlan(self.step_id, rows, len(decode_rows), self.max_num_batched_tokens - budget, preempted,
                       drained)

    def _reserve(self, request: RefRequest, num_tokens: int, scheduled: set[int],
                 preempted: list[RefRequest]) -> bool:
        need = self.blocks.extra_blocks_needed(request, num_tokens)
        while need > len(self.blocks.free_list):
            victim = next((r for r in reversed(self.running)
                           if id(r) not in scheduled and r is not request and r.status is RequestStatus.RUNNING),
                          None)
            self._preempt(victim or request)
            preempted.append(victim or request)
            if victim is None:
                return False
        self.blocks.allocate(request, num_tokens)
        return True

    def _advance(self, request: RefRequest, n: int, is_decode: bool) -> RefRow:
        start = request.num_computed_tokens
        request.num_computed_tokens += n
        samples = request.num_computed_tokens == request.num_tokens
        if samples:
            request.num_pending += 1
            if request.num_scheduled_outputs >= request.params.max_tokens:
                request.status = RequestStatus.DRAINING
        return RefRow(request, start, n, samples, is_decode)

    def _preempt(self, request: RefRequest) -> None:
        self.num_preemptions += 1
        request.num_preemptions += 1
        self._release(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        index = 0
        for index, other in enumerate(self.waiting):
            if other.arrival_seq > request.arrival_seq:
                break
        else:
            index = len(self.waiting)
        self.waiting.insert(index, request)

    def apply(self, plan: RefPlan, token_ids: np.ndarray, finite: np.ndarray) -> AppliedStep:
        seqs: list[int] = []
        kept: list[int] = []
        finish: list[int] = []
        errored: list[int] = []
        tokens, ok = token_ids.tolist(), finite.tolist()
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
            if token == self.eos_token_id and not params.ignore_eos:
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

    def release_drained(self, plan: RefPlan) -> None:
        for request in plan.drained:
            self._release(request)

    def finish(self, request: RefRequest, reason: str, stop_reason: int | None = None) -> None:
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

    def _release(self, request: RefRequest) -> None:
        self.blocks.free(request)
        if request.token_row is not None:
            self.free_rows.append(request.token_row)
            request.token_row = None


class RefWriter:
    """The old ``StepMetadataWriter``: a per-request ``_refresh`` for every row of every step."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        s = max_num_seqs
        self.owner: list[RefRequest | None] = [None] * s
        self.generation = np.zeros(s, dtype=np.int64)
        self.blocks_known = np.zeros(s, dtype=np.int64)
        self.block_table = np.zeros((s, max_blocks_per_seq), dtype=np.int64)
        kinds = {"seed": np.int64, "top_k": np.int64, "temperature": np.float32, "top_p": np.float32,
                 "min_p": np.float32, "presence": np.float32, "frequency": np.float32, "repetition": np.float32}
        self.constants = {name: np.zeros(s, dtype=dtype) for name, dtype in kinds.items()}
        self.uses_penalty = np.zeros(s, dtype=bool)

    def _refresh(self, request: RefRequest) -> int:
        row = request.token_row
        if self.owner[row] is not request or self.generation[row] != request.num_preemptions:
            self.owner[row] = request
            self.generation[row] = request.num_preemptions
            self.blocks_known[row] = 0
            p = request.params
            values = (request.seed, max(p.top_k, 0), p.temperature, p.top_p, p.min_p, p.presence_penalty,
                      p.frequency_penalty, p.repetition_penalty)
            for name, value in zip(self.constants, values):
                self.constants[name][row] = value
            self.uses_penalty[row] = p.uses_penalties
        blocks = request.block_ids
        known = int(self.blocks_known[row])
        if known != len(blocks):
            self.block_table[row, known:len(blocks)] = blocks[known:]
            self.blocks_known[row] = len(blocks)
        return row

    def write(self, plan: RefPlan, staging: StagingBuffer) -> dict:
        bs = self.block_size
        sample_rows: list[int] = []
        sample_steps: list[int] = []
        logits_idx: list[int] = []
        context_tokens = 0
        max_blocks_used = 0
        prefill: list[tuple[int, int, int, int, int]] = []
        first_chunks: list[int] = []
        t = 0
        for index, row in enumerate(plan.rows):
            request = row.request
            ts = self._refresh(request)
            n, start = row.num_tokens, row.start
            end = start + n
            prompt_len = len(request.prompt_token_ids)
            pos = np.arange(start, end, dtype=np.int64)
            if row.is_decode:
                staging.decode_token_rows[index] = ts
                nb = start // bs + 1
                max_blocks_used = max(max_blocks_used, nb)
                staging.decode_block_tables[index, :nb] = self.block_table[ts, :nb]
                staging.decode_context_lens[index] = end
            else:
                all_ids = request.prompt_token_ids + request.output_token_ids
                staging.input_ids[t:t + n] = all_ids[start:end]
                nb = -(-end // bs)
                p = index - plan.num_decode
                staging.prefill_block_tables[p, :nb] = self.block_table[ts, :nb]
                prefill.append((t, n, end, ts, nb))
                staging.prefill_row_spans[p] = (t, n, end)
                if start == 0:
                    staging.first_chunk_token_rows[len(first_chunks)] = ts
                    first_chunks.append(ts)
            staging.positions[t:t + n] = pos
            staging.slot_mapping[t:t + n] = self.block_table[ts, pos // bs] * bs + pos % bs
            staging.token_is_output[t:t + n] = pos >= prompt_len
            staging.token_owner_row[t:t + n] = ts
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
        for name, array in self.constants.items():
            getattr(staging, f"sample_{name}")[:r] = array[ss]
        temps, top_k = self.constants["temperature"][ss], self.constants["top_k"][ss]
        top_p, min_p = self.constants["top_p"][ss], self.constants["min_p"][ss]
        random_rows = temps > 0
        return {
            "step_id": plan.step_id, "num_tokens": t, "num_decode": plan.num_decode,
            "decode_max_blocks": max_blocks_used, "prefill_rows": prefill, "num_sampled": r,
            "context_tokens": context_tokens, "all_greedy": not bool(random_rows.any()),
            "any_filter": bool((random_rows & ((top_k > 0) | (top_p < 1) | (min_p > 0))).any()),
            "any_penalty": bool(self.uses_penalty[ss].any()) or any(self.uses_penalty[p[3]] for p in prefill),
            "first_chunk_rows": first_chunks,
        }
