"""The sampler's per-step extras: logit bias, ``min_tokens``, logprobs, prompt logprobs, grammar rows.

Built by the planner next to the step's metadata (``StepMetadataWriter``),
only for rows whose request asked for one of them (``RowState.needs_extras``):
a step where none did gets ``None`` and costs one cached flag check. What a
decode row set needs is cached per ``decode_version`` (the rows' requests do
not change within a version); what depends on the step (``min_tokens`` against
the output index) is recomputed for the few rows that have it.

Grammar rows get an empty ``GrammarMask``: the planner fills it later, once the
tokens of every earlier step were applied (``engine.structured_state``). In a
verify step each decode grammar row gets a mask per position (``1 + spec_depth``);
with a draft model the host walks its drafts once the device offers them
(``GrammarMask.device_drafts``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncbatch.engine.row_state import RowState
from asyncbatch.engine.step_contract import (
    ALWAYS,
    GrammarMask,
    LogprobRows,
    PromptLogprobRows,
    SamplerExtras,
    SparseBias,
)
from asyncbatch.engine.step_plan import StepPlan

_NONE = np.zeros(0, dtype=np.int64)
_MASK_RING = 3  # two steps are in flight at most; one more for margin


@dataclass(slots=True)
class _DecodeExtras:
    """Which decode rows (indices into the decode set) need extras, for one ``decode_version``."""

    version: int
    any: bool
    logprob_index: np.ndarray  # [L]
    bias_index: np.ndarray  # [B]
    grammar_index: np.ndarray  # [G]


class StepExtrasWriter:
    """Builds ``SamplerExtras`` for the steps of one scheduler (planner thread only)."""

    def __init__(self, rows: RowState, eos_token_id: int | None, bitmask_words: int, max_width: int = 1,
                 drafts_on_device: bool = False) -> None:
        self.rows = rows
        self.eos_token_id = eos_token_id
        self.bitmask_words = bitmask_words
        self.max_width = max_width  # positions a decode row may compute: 1 + num_speculative_tokens
        self.drafts_on_device = drafts_on_device  # a draft model: drafts made in the step that checks them
        self._decode = _DecodeExtras(-1, False, _NONE, _NONE, _NONE)
        # Grammar masks by step id modulo the ring: reused, not allocated (and page-faulted) every step. A
        # step's mask is read until its sampling is done, before the planner waits for that step; the step
        # that reuses it is planned after that wait.
        self._mask_ring: list[np.ndarray] = []

    def build(self, plan: StepPlan, sampled_rows: np.ndarray, sample_steps: np.ndarray) -> SamplerExtras | None:
        """Extras of a step whose sampled rows are ``sampled_rows`` ``[R]`` (token rows, sample order: the decode
        rows first) sampling output index ``sample_steps`` ``[R]``."""
        st, nd = self.rows, plan.num_decode
        decode = self._decode_extras(plan) if nd else None
        prefill_index = st.needs_extras[sampled_rows[nd:]].nonzero()[0] + nd  # [P'] sample indices
        prompt = self._prompt_logprobs(plan)
        if (decode is None or not decode.any) and not len(prefill_index) and prompt is None:
            return None
        empty = decode is None or not decode.any
        lp_index = np.concatenate([_NONE if empty else decode.logprob_index,
                                   prefill_index[st.logprobs_k[sampled_rows[prefill_index]] >= 0]])
        bias_index = np.concatenate([_NONE if empty else decode.bias_index,
                                     prefill_index[st.has_bias[sampled_rows[prefill_index]]]])
        decode_grammar = _NONE if empty else decode.grammar_index
        grammar_index = np.concatenate([decode_grammar, prefill_index[st.has_grammar[sampled_rows[prefill_index]]]])
        logprobs = None
        if len(lp_index):
            k = st.logprobs_k[sampled_rows[lp_index]]
            logprobs = LogprobRows(lp_index, k, int(k.max()))
        grammar = None
        if len(grammar_index):
            width = plan.spec_depth + 1
            rows = GrammarMask.num_mask_rows(len(grammar_index), len(decode_grammar), width)
            grammar = GrammarMask(grammar_index, st.seq[sampled_rows[grammar_index]],
                                  self._mask_buffer(plan.step_id)[:rows], width, len(decode_grammar),
                                  self.drafts_on_device)
        return SamplerExtras(self._bias(bias_index, sampled_rows, sample_steps), logprobs, prompt, grammar)

    def _mask_buffer(self, step_id: int) -> np.ndarray:
        if not self._mask_ring:
            self._mask_ring = [np.zeros((len(self.rows.seq) * self.max_width, self.bitmask_words), dtype=np.int32)
                               for _ in range(_MASK_RING)]
        return self._mask_ring[step_id % _MASK_RING]

    def _decode_extras(self, plan: StepPlan) -> _DecodeExtras:
        if self._decode.version != plan.decode_version:
            st, rows = self.rows, plan.decode_rows
            needs = st.needs_extras[rows]  # [D]
            if needs.any():
                self._decode = _DecodeExtras(plan.decode_version, True, (st.logprobs_k[rows] >= 0).nonzero()[0],
                                             st.has_bias[rows].nonzero()[0], st.has_grammar[rows].nonzero()[0])
            else:
                self._decode = _DecodeExtras(plan.decode_version, False, _NONE, _NONE, _NONE)
        return self._decode

    def _bias(self, index: np.ndarray, sampled_rows: np.ndarray, steps: np.ndarray) -> SparseBias | None:
        """``logit_bias`` entries, and -inf on EOS and the stop ids of rows that may still be short of
        ``min_tokens``, with ``until`` = ``min_tokens`` for the device to decide per position. "May": the output
        index sampled now is at least the smaller of ``steps`` (the host's index of each sampled row, exact
        without speculation) and the outputs applied so far (exact as of the last applied step); in a
        speculative engine only the device knows it exactly."""
        if not len(index):
            return None
        st = self.rows
        parts_index, parts_tokens, parts_values, parts_until = [], [], [], []
        for i in index.tolist():
            row = int(sampled_rows[i])
            params = st.params[row]
            tokens, values = st.bias[row]
            until = np.full(len(tokens), ALWAYS, dtype=np.int64)
            if min(int(steps[i]), int(st.num_outputs[row])) < params.min_tokens:
                banned = list(params.stop_token_ids or ())
                if self.eos_token_id is not None:
                    banned.append(self.eos_token_id)
                tokens = np.concatenate([tokens, np.asarray(banned, dtype=np.int64)])
                values = np.concatenate([values, np.full(len(banned), -np.inf, dtype=np.float32)])
                until = np.concatenate([until, np.full(len(banned), params.min_tokens, dtype=np.int64)])
            if len(tokens):
                parts_index.append(np.full(len(tokens), i, dtype=np.int64))
                parts_tokens.append(tokens)
                parts_values.append(values)
                parts_until.append(until)
        if not parts_index:
            return None
        return SparseBias(np.concatenate(parts_index), np.concatenate(parts_tokens), np.concatenate(parts_values),
                          np.concatenate(parts_until))

    def _prompt_logprobs(self, plan: StepPlan) -> PromptLogprobRows | None:
        """Prompt positions this step's prefill chunks score: the logits at position ``q`` score token ``q + 1``;
        each position once (``Request.prompt_logprobs_next``), so recomputes and later chunks add none."""
        token_index, targets, seqs, counts, ks = [], [], [], [], []
        t = plan.num_decode_tokens  # the prefill tokens follow the decode rows' (1 + spec_depth each)
        for row in plan.prefill:
            request = row.request
            k = request.params.prompt_logprobs
            prompt_len = len(request.prompt_token_ids)
            if k is not None and request.prompt_logprobs_next < prompt_len:
                end = row.start + row.num_tokens
                first = max(row.start, request.prompt_logprobs_next - 1)
                last = min(end, prompt_len - 1)  # positions [first, last) score tokens first+1 .. last
                if last > first:
                    token_index.append(np.arange(t + first - row.start, t + last - row.start, dtype=np.int64))
                    targets.append(np.asarray(request.prompt_token_ids[first + 1:last + 1], dtype=np.int64))
                    seqs.append(request.arrival_seq)
                    counts.append(last - first)
                    ks.append(k)
                    request.prompt_logprobs_next = last + 1
            t += row.num_tokens
        if not seqs:
            return None
        k_arr = np.asarray(ks, dtype=np.int64)
        return PromptLogprobRows(np.concatenate(token_index), np.concatenate(targets), np.asarray(seqs, dtype=np.int64),
                                 np.asarray(counts, dtype=np.int64), k_arr, int(k_arr.max()))
