"""Real execution of a step with torch: ``TorchStep``, which both torch executors use, and the ``cpu`` backend.

``TorchStep`` owns the model, the KV cache, the device token buffer and the penalty
state, and runs one step over them: ``copy_in`` (staging buffer → device tensors) and
``compute`` (forward, penalties, sampling, token buffer update). It has no thread and
no stream; the executor holding it decides where the step runs. ``CudaExecutor``
calls it from the planner thread inside its CUDA streams. ``TorchExecutor`` (``cpu``)
runs it in a ``DeviceThread``; torch releases the GIL inside its kernels, so the
planner plans the next step meanwhile:

    planner        [launch N]─queue─►            [plan N+1][launch N+1]─queue─►   [wait N]
    device thread            [copy staging → fence][forward N | sample N]      [copy N+1 → fence] ...
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from asyncbatch.engine.step_contract import DUMMY_BLOCK, GrammarMask, StepMeta
from asyncbatch.executors.base import StepHandle, StepResult
from asyncbatch.executors.device_thread import DeviceThread, ThreadedExecutor
from asyncbatch.executors.kernel_threads import claim_kernel_threads
from asyncbatch.model.compiled_decode import CompiledDecode, is_pure_decode
from asyncbatch.model.forward_batch import ForwardBatch, PagedForwardBatch, PrefillRow
from asyncbatch.model.llama import CausalLM
from asyncbatch.model.packed_linears import PackedLinear
from asyncbatch.model.quantization import packed_bytes
from asyncbatch.profiling.marks import mark
from asyncbatch.profiling.memory import module_mib, tensor_mib
from asyncbatch.sampling.logit_bias import apply_sparse_bias_
from asyncbatch.sampling.logprobs import TokenLogprobs, token_logprobs
from asyncbatch.sampling.penalties import PenaltyState
from asyncbatch.sampling.sampler import SamplingTensors, sample
from asyncbatch.sampling.token_bitmask import apply_bitmask_
from asyncbatch.speculative.config import SpeculativeConfig
from asyncbatch.speculative.device_state import DecodeInputs, SpeculativeState, Verified
from asyncbatch.speculative.draft_model import DraftModel


def _expand_decode(num_decode: int, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``[R]`` per-row values -> ``[D * W + R - D]``: each decode row's repeated for its ``W`` positions."""
    def expand(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values[:num_decode].repeat_interleave(width), values[num_decode:]])
    return expand


@dataclass(slots=True)
class PenaltyInputs:
    presence: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    repetition: torch.Tensor  # [R] float32
    token_is_output: torch.Tensor  # [T] bool
    token_owner_row: torch.Tensor  # [T] int64
    first_chunk_rows: torch.Tensor  # [K] int64, token rows whose request (re)starts its prefill
    # A reused cached prefix's tokens, counted as if computed: ([C] rows, [C] token ids, [C] is_output), or None.
    cached_context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class ExtrasInputs:
    """``SamplerExtras`` on the device (``None`` where the step has no such rows)."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # [N] sample index, token ids,
    # values, until (``SparseBias``)
    logprob_index: torch.Tensor | None  # [L] sample index
    prompt_targets: torch.Tensor | None  # [P] token ids scored by the logits after the R sampled rows
    grammar_index: torch.Tensor | None  # [G] sample index


@dataclass(slots=True)
class DeviceStep:
    """One step's inputs on the device, as ``TorchStep.copy_in`` made them."""

    batch: ForwardBatch
    sampling: SamplingTensors
    decode_rows: torch.Tensor  # [num_decode] int64, token-buffer rows the decode inputs come from
    sample_rows: torch.Tensor  # [R] int64, token-buffer rows the sampled tokens go to
    penalty: PenaltyInputs | None
    extras: ExtrasInputs | None = None
    token_owner_row: torch.Tensor | None = None  # [T] int64 (speculative engines: the token history's rows)
    verify: DecodeInputs | None = None  # speculative engines: the decode rows' tokens, derived on the device
    num_decode_tokens: int = 0  # the decode rows' tokens as computed (speculative: D * verify.width)


@dataclass(slots=True)
class StepOutcome:
    """What ``TorchStep.compute`` produced, on the device (``*_logprobs`` None unless asked for).

    A speculative engine's step (``num_emitted`` not None): ``token_ids`` is ``[R, 1 + depth]``, row ``i``
    emitted its first ``num_emitted[i]``; the draft counts are for the metrics."""

    token_ids: torch.Tensor  # [R] int64, or [R, W] (speculative)
    finite: torch.Tensor  # [R] bool
    sample_start: float  # host clock when the forward was done (sampling began, or its mask wait)
    mask_wait_ms: float = 0.0
    mask_wait_start: float = 0.0  # host clock when the wait for the grammar mask began
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    num_emitted: torch.Tensor | None = None  # [R] int64 (speculative)
    spec_counts: tuple[int, int, int] = (0, 0, 0)  # rows that verified drafts, draft tokens, accepted tokens
    grammar_drafts: torch.Tensor | None = None  # [G, k] int64 the grammar rows' next drafts (n-gram)
    grammar_num_drafts: torch.Tensor | None = None  # [G] int64


class _ExtrasAt:
    """A step's sampler extras (``SamplerExtras``) and where their rows' logits are.

    The extras index the sampled rows (decode rows first); ``layout`` ``(num_decode, width, decode_tokens)``
    says that the logits are a verify step's instead, ``width`` positions a decode row and then the prefill
    rows. A decode grammar row's mask of each position (``GrammarMask.width`` a row, the host's walk along its
    drafts) applies at that position. A decode row's bias entries apply at each of its positions whose output
    index is below the entry's ``until`` (``min_tokens``' bans end there). A logprob row is scored at every
    position it computed, in row order (``LogprobRows.entries``): the host keeps the entries of the tokens the
    row emitted. Also collects the grammar mask's wait for the ``StepOutcome``."""

    __slots__ = ("_layout", "_logprob_rows", "extras", "inputs", "mask_wait_ms", "mask_wait_start")

    def __init__(self, meta: StepMeta, step: DeviceStep, layout: tuple[int, int, int] | None) -> None:
        self.extras, self.inputs, self._layout = meta.extras, step.extras, layout
        self.mask_wait_start = self.mask_wait_ms = 0.0
        self._logprob_rows: torch.Tensor | None = None

    def at(self, index: torch.Tensor) -> torch.Tensor:
        """Sampled-row indices ``[N]`` -> logits rows ``[N]`` (each row's first position)."""
        if self._layout is None:
            return index
        nd, width, nt = self._layout
        return torch.where(index < nd, index * width, index + (nt - nd))

    def spans(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled-row indices ``[N]`` (decode rows first) -> ``[E]`` the logits rows of every position each
        computed (a verify step's decode rows ``width`` each, in order), and which of the ``N`` each is (None:
        ``E == N``, one each, in order)."""
        if self._layout is None:
            return index, None
        nd, width, nt = self._layout
        d = int((index < nd).sum())  # decode rows come first
        at = (index[:d, None] * width + torch.arange(width, device=index.device)[None, :]).reshape(-1)
        entry = torch.arange(len(index), device=index.device)
        return (torch.cat([at, index[d:] + (nt - nd)]),
                torch.cat([entry[:d].repeat_interleave(width), entry[d:]]))

    def mask_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``[E]`` the logits rows the grammar mask applies to, ``[E]`` the bitmask row of each; None: the
        bitmask's rows in order): a decode row's ``width`` positions get its ``width`` bitmask rows (the first
        ``width`` of its ``GrammarMask.width``: the host filled one per position it may compute)."""
        grammar, index = self.extras.grammar, self.inputs.grammar_index
        if grammar.width == 1:
            return self.at(index), None
        gd = grammar.num_decode
        first = torch.from_numpy(grammar.first_rows()).to(index.device)  # [G] each row's first bitmask row
        if self._layout is None:  # no row had a draft to check: one position each
            return index, first
        nd, width, nt = self._layout
        offsets = torch.arange(width, device=index.device)
        return (torch.cat([(index[:gd, None] * width + offsets).reshape(-1), index[gd:] + (nt - nd)]),
                torch.cat([(first[:gd, None] + offsets).reshape(-1), first[gd:]]))

    def logprob_rows(self) -> torch.Tensor:
        """``[E]`` the logits rows the logprob entries score: a verify step's decode rows at every position."""
        if self._logprob_rows is None:
            self._logprob_rows = self.spans(self.inputs.logprob_index)[0]
        return self._logprob_rows

    def raw_logprobs(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``[E, V]`` the logprob entries' logits, before penalties or anything else changes them."""
        if self.extras is None or self.extras.logprobs is None:
            return None
        return logits.index_select(0, self.logprob_rows())

    def chosen_logprobs(self, raw: torch.Tensor | None, token_ids: torch.Tensor) -> TokenLogprobs | None:
        """The logprob entries' sampled tokens (``token_ids``: every logits row's) scored under ``raw``."""
        if raw is None:
            return None
        return token_logprobs(raw, token_ids.index_select(0, self.logprob_rows()), self.extras.logprobs.max_k)


class TorchStep:
    """One step over the model, its KV cache, the device token buffer and the penalty state.

    ``non_blocking_uploads``: each input is a non-blocking copy on the current stream,
    which reads the (pinned) staging buffer until it completes; the caller keeps the
    staging buffer unchanged until then (its fence). Otherwise every input is a private
    copy, complete when ``copy_in`` returns. ``paged``: the Triton attention kernels run,
    which read whole block-table rows and take a ``PagedForwardBatch``.
    """

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_num_seqs: int,
                 device: torch.device, *, non_blocking_uploads: bool = False, paged: bool = False,
                 speculative: SpeculativeConfig | None = None, max_model_len: int = 0,
                 draft: DraftModel | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.non_blocking_uploads = non_blocking_uploads
        self.paged = paged
        # One row per token row, plus a last dummy row that padding rows of CUDA graphs read and
        # write (``DecodeGraphStep.dummy_token_row``).
        self.token_buffer = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)  # [max_num_seqs + 1]
        self.penalties = PenaltyState(max_num_seqs, model.config.vocab_size, self.device)
        # Set by ``TorchExecutor(compile_decode=True)``: the compiled forward of pure decode steps.
        self.decode_forward: CompiledDecode | None = None
        self.compiled_steps = 0
        # Speculative engines: every decode row's inputs come from this state (``docs/speculative.md``).
        self.spec = None if speculative is None else SpeculativeState(speculative, max_num_seqs, max_model_len,
                                                                       self.device)
        self.block_size = kv_caches[0][0].shape[1] if kv_caches else 1
        # ``method="draft_model"``: the draft and its KV cache (the target's block layout), run in each step.
        self.draft = draft

    # -- host → device ------------------------------------------------------------------
    def upload(self, array: np.ndarray) -> torch.Tensor:
        if self.non_blocking_uploads:
            return torch.from_numpy(array).to(self.device, non_blocking=True)
        return torch.from_numpy(array).clone()

    def _table_rows(self, table: np.ndarray, rows: int, width: int) -> np.ndarray:
        """The part of a ``[S, max_blocks]`` block table the step needs."""
        if self.paged:
            # Whole rows are one contiguous pinned range, so the copy is a true async DMA; the Triton
            # kernels read only the blocks a row's context covers, whatever the width. The torch
            # reference gathers every column, so it gets the narrow (strided) copy.
            return table[:rows]
        return table[:rows, :max(width, 1)]

    def _make_batch(self, meta: StepMeta, prefill_tables: torch.Tensor, **fields: object) -> ForwardBatch:
        if not self.paged:
            return ForwardBatch(**fields)
        rows = meta.prefill_rows
        prefill_meta = self.upload(meta.staging.prefill_row_spans[:len(rows)])
        return PagedForwardBatch(**fields, prefill_meta=prefill_meta, prefill_tables=prefill_tables,
                                 max_prefill_len=max((p.q_len for p in rows), default=0))

    def copy_in(self, meta: StepMeta, forward: bool = True) -> DeviceStep:
        """The step's inputs on the device. ``forward=False``: a decode-only step whose forward a CUDA graph
        replays from its own inputs, so only what sampling reads is uploaded (the batch's tensors are empty)."""
        s, t, nd, r = meta.staging, meta.num_tokens, meta.num_decode, meta.num_sampled
        if not forward and nd != t:
            raise ValueError(f"copy_in(forward=False) is for decode-only steps, got {nd} decode rows of {t} tokens")
        up = self.upload
        if forward:
            input_ids = up(s.input_ids[:t])
            positions = up(s.positions[:t])
            slot_mapping = up(s.slot_mapping[:t])
        decode_rows = up(s.decode_token_rows[:nd])
        if forward:
            decode_tables = up(self._table_rows(s.decode_block_tables, nd, meta.decode_max_blocks))
            decode_lens = up(s.decode_context_lens[:nd])
            npre = len(meta.prefill_rows)
            prefill_width = max((p.block_count for p in meta.prefill_rows), default=1)
            prefill_tables = up(self._table_rows(s.prefill_block_tables, npre, prefill_width))
        sampling = SamplingTensors(
            temperature=up(s.sample_temperature[:r]), top_k=up(s.sample_top_k[:r]), top_p=up(s.sample_top_p[:r]),
            min_p=up(s.sample_min_p[:r]), seed=up(s.sample_seed[:r]), step=up(s.sample_step[:r]))
        logits_indices = up(s.logits_indices[:r])
        extras = self._extras_in(meta)
        if meta.extras is not None and meta.extras.prompt_logprobs is not None:  # their logits come after the R
            logits_indices = torch.cat([logits_indices, up(meta.extras.prompt_logprobs.token_index)])
        sample_rows = up(s.sample_token_rows[:r])
        penalty = None
        if self.spec is not None:  # the prefill tokens' rows, for the device's token history
            token_owner = up(s.token_owner_row[:t])
        if meta.any_penalty:
            cached = meta.cached_context
            penalty = PenaltyInputs(presence=up(s.sample_presence[:r]), frequency=up(s.sample_frequency[:r]),
                                    repetition=up(s.sample_repetition[:r]), token_is_output=up(s.token_is_output[:t]),
                                    token_owner_row=token_owner if self.spec is not None else up(
                                        s.token_owner_row[:t]),
                                    first_chunk_rows=up(s.first_chunk_token_rows[:len(meta.first_chunk_rows)]),
                                    cached_context=None if cached is None else (
                                        up(cached.rows), up(cached.token_ids), up(cached.is_output)))
        if forward:
            rows = [PrefillRow(p.token_start, p.q_len, p.ctx_len, prefill_tables[i, :p.block_count])
                    for i, p in enumerate(meta.prefill_rows)]
            batch = self._make_batch(meta, prefill_tables, input_ids=input_ids, positions=positions,
                                     slot_mapping=slot_mapping, num_decode=nd, decode_block_tables=decode_tables,
                                     decode_context_lens=decode_lens, prefill_rows=rows, logits_indices=logits_indices)
        else:
            none = torch.empty(0, dtype=torch.int64, device=self.device)
            batch = ForwardBatch(input_ids=none, positions=none, slot_mapping=none, num_decode=nd,
                                 decode_block_tables=none.view(0, 1), decode_context_lens=none, prefill_rows=[],
                                 logits_indices=logits_indices)
        return DeviceStep(batch, sampling, decode_rows, sample_rows, penalty, extras,
                          token_owner if self.spec is not None else None)

    def _extras_in(self, meta: StepMeta) -> ExtrasInputs | None:
        extras = meta.extras
        if extras is None:
            return None
        up = self.upload
        bias = extras.bias
        return ExtrasInputs(
            bias=None if bias is None else (up(bias.index), up(bias.token_ids), up(bias.values), up(bias.until)),
            logprob_index=None if extras.logprobs is None else up(extras.logprobs.index),
            prompt_targets=None if extras.prompt_logprobs is None else up(extras.prompt_logprobs.target_ids),
            grammar_index=None if extras.grammar is None else up(extras.grammar.index))

    # -- the step ------------------------------------------------------------
    def compute(self, meta: StepMeta, step: DeviceStep, forward_hook: Callable[[StepMeta], None] | None = None,
                sample_event: torch.cuda.Event | None = None) -> StepOutcome:
        """Forward, then ``sample``. ``forward_hook`` runs before the forward (tests inject faults there);
        ``sample_event`` is recorded on the current stream between the forward and the sampler."""
        logits = self.forward(meta, step, forward_hook)
        t_sample = time.perf_counter()
        if sample_event is not None:
            sample_event.record()
        if self.spec is not None:
            return self.sample_verified(meta, step, logits, t_sample)
        return self.sample(meta, step, logits, t_sample)

    def forward(self, meta: StepMeta, step: DeviceStep,
                forward_hook: Callable[[StepMeta], None] | None = None) -> torch.Tensor:
        """The model over the step's tokens: logits ``[R (+ P prompt positions), vocab]`` float32."""
        batch, nd = step.batch, meta.num_decode
        if self.spec is not None:
            self._verify_inputs(meta, step)
        elif nd:
            # The token sampled last step feeds this one without visiting the host.
            batch.input_ids[:nd] = self.token_buffer[step.decode_rows]
        compiled = self.decode_forward is not None and is_pure_decode(batch)
        with mark("forward", meta.step_id, " compiled" if compiled else " eager"):
            if forward_hook is not None:
                forward_hook(meta)
            if compiled:
                self.compiled_steps += 1
                return self.decode_forward(batch)  # [R, vocab]
            return self.model(batch, self.kv_caches)

    def _verify_inputs(self, meta: StepMeta, step: DeviceStep) -> None:
        """A speculative engine's step: the decode rows' tokens (input token and drafts), positions, slots and
        contexts from the device's state; the prefill tokens into the token history.

        The plan laid out ``1 + spec_depth`` tokens a decode row; when no row can use that many drafts the
        step computes fewer (``DecodeInputs.width``), and the prefill tokens move up to follow them."""
        batch, nd, planned = step.batch, meta.num_decode, meta.num_decode_tokens
        nt = 0
        dummy_slot = DUMMY_BLOCK * self.block_size
        proposed = self.draft is not None and nd > 0 and meta.spec_depth > 0
        if proposed:  # drafts of this step's decode rows, before their tables become per-position ones
            with mark("draft_propose", meta.step_id):
                self.draft.propose(self.spec, step.decode_rows, meta.spec_depth, batch.decode_block_tables,
                                   batch.decode_context_lens, self.token_buffer, dummy_slot)
            grammar = meta.extras.grammar if meta.extras is not None else None
            if grammar is not None and grammar.device_drafts:  # the host walks its matchers along them now
                grammar.offer_drafts(*(t.cpu().numpy() for t in self._grammar_rows_drafts(step)))
        if nd:
            v = self.spec.decode_inputs(step.decode_rows, meta.spec_depth, batch.decode_block_tables,
                                        batch.decode_context_lens, self.token_buffer, self.block_size, dummy_slot)
            step.verify, nt = v, nd * v.width
            if nt < planned:
                self._close_gap(step, planned, nt)
            batch.input_ids[:nt] = v.input_ids
            batch.positions[:nt] = v.positions
            batch.slot_mapping[:nt] = v.slot_mapping
            batch.num_decode = nt
            batch.decode_block_tables, batch.decode_context_lens = v.block_tables, v.context_lens
            if nt != nd:  # every decode token is sampled; the prefill rows' indices already count them
                batch.logits_indices = torch.cat([torch.arange(nt, device=self.device), batch.logits_indices[nd:]])
        step.num_decode_tokens = nt
        if meta.history_context is not None:  # reused cached prefixes: their tokens were not computed here
            up, cached = self.upload, meta.history_context
            self.spec.write_prefill(up(cached.rows), up(cached.positions), up(cached.token_ids))
        if meta.num_tokens > planned:
            self.spec.write_prefill(step.token_owner_row[nt:], batch.positions[nt:], batch.input_ids[nt:])
        if self.draft is not None:  # the draft's KV follows the target's, slot for slot (``draft_model``)
            with mark("draft_follow", meta.step_id):
                self.draft.follow(batch, nd, step.verify.usable_drafts if proposed else None)

    @staticmethod
    def _close_gap(step: DeviceStep, planned: int, nt: int) -> None:
        """Move the prefill tokens from ``planned`` (the plan's decode tokens) to ``nt`` (the computed ones):
        every per-token tensor loses entries ``nt .. planned``, and every index past them shifts down."""
        shift = planned - nt
        batch, penalty = step.batch, step.penalty

        def cut(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[:nt], t[planned:]])

        batch.input_ids, batch.positions, batch.slot_mapping = cut(batch.input_ids), cut(batch.positions), \
            cut(batch.slot_mapping)
        step.token_owner_row = cut(step.token_owner_row)
        if penalty is not None:
            penalty.token_owner_row, penalty.token_is_output = step.token_owner_row, cut(penalty.token_is_output)
        nd = len(step.decode_rows)
        batch.logits_indices = torch.cat([batch.logits_indices[:nd], batch.logits_indices[nd:] - shift])
        batch.prefill_rows = [PrefillRow(row.token_start - shift, row.q_len, row.ctx_len, row.block_table)
                              for row in batch.prefill_rows]

    def sample(self, meta: StepMeta, step: DeviceStep, logits: torch.Tensor, t_sample: float,
               wait_for_mask: bool = True) -> StepOutcome:
        """Penalties, bias, the grammar mask, sampling and logprobs over ``forward``'s logits.

        With a ``GrammarMask`` and ``wait_for_mask``, blocks (this thread only) until the planner filled it;
        the logprob rows' distributions are taken before, from the raw logits.
        """
        r = meta.num_sampled
        prompt = self._prompt_logprobs(meta, step, logits[r:])
        logits = logits[:r]
        extras = _ExtrasAt(meta, step, None)
        raw_logprobs = extras.raw_logprobs(logits)
        with mark("sample", meta.step_id):
            penalty = step.penalty
            if penalty is not None:
                self._update_penalty_context(meta, step.batch, penalty)
                logits = self.penalties.apply(logits, step.sample_rows, penalty.presence, penalty.frequency,
                                              penalty.repetition)
            logits = self._bias_and_mask(meta, logits, step.sampling.step, extras, copied=penalty is not None,
                                         wait_for_mask=wait_for_mask)
            result = sample(logits, step.sampling, all_greedy=meta.all_greedy, any_top_k_top_p_min_p=meta.any_filter)
            if penalty is not None:
                self.penalties.record(step.sample_rows, result.token_ids)
            self.token_buffer[step.sample_rows] = result.token_ids
            chosen = extras.chosen_logprobs(raw_logprobs, result.token_ids)
        return StepOutcome(result.token_ids, result.finite, t_sample, extras.mask_wait_ms, extras.mask_wait_start,
                           chosen, prompt)

    @staticmethod
    def _prompt_logprobs(meta: StepMeta, step: DeviceStep, logits: torch.Tensor) -> TokenLogprobs | None:
        """The prompt positions' logprobs (``logits``: theirs, after the sampled rows')."""
        extras = meta.extras
        if extras is None or extras.prompt_logprobs is None:
            return None
        return token_logprobs(logits, step.extras.prompt_targets, extras.prompt_logprobs.max_k)

    def _bias_and_mask(self, meta: StepMeta, logits: torch.Tensor, steps: torch.Tensor, extras: _ExtrasAt,
                       copied: bool, wait_for_mask: bool) -> torch.Tensor:
        """``logit_bias`` / ``min_tokens`` and the grammar mask on their rows of ``logits`` (a copy unless
        ``copied``: the forward's output may be a reused buffer; ``steps``: each logits row's output index);
        waits for the mask if ``wait_for_mask``.

        A grammar that allows only what ``min_tokens`` bans (it is complete: only EOS is left) wins: such a
        position gets its logits before the bias under the mask alone, so the request stops there with
        ``finish_reason="stop"`` instead of sampling from nothing (vLLM's "terminal grammars stop under
        min_tokens")."""
        x, xin = meta.extras, extras.inputs
        if x is None or (x.bias is None and x.grammar is None):
            return logits
        if not copied:
            logits = logits.clone()
        mask_rows = extras.mask_rows() if x.grammar is not None else None
        unbiased = None  # [E, V] the grammar positions' logits before the bias, when both apply
        if x.bias is not None and mask_rows is not None:
            unbiased = logits.index_select(0, mask_rows[0])
        if x.bias is not None:
            index, token_ids, values, until = xin.bias
            at, entry = extras.spans(index)  # [E] every position of each entry's row
            if entry is not None:
                token_ids, values, until = (t.index_select(0, entry) for t in (token_ids, values, until))
            apply_sparse_bias_(logits, at, token_ids, torch.where(steps.index_select(0, at) < until, values, 0.0))
        if x.grammar is not None:
            if wait_for_mask:
                extras.mask_wait_start, extras.mask_wait_ms = self._wait_for_mask(meta)
            self._apply_mask(logits, x.grammar, *mask_rows, unbiased)
        return logits

    def sample_verified(self, meta: StepMeta, step: DeviceStep, logits: torch.Tensor, t_sample: float) -> StepOutcome:
        """A speculative engine's sampling: every position of every decode row is sampled (its penalties seeing
        the drafts before it), the confirmed drafts are kept (``SpeculativeState.accept``), the rows that ended
        their prefill start, and every sampled row drafts its next step's tokens.

        A grammar row's mask of each position applies there (the host walked its matcher along the drafts,
        which this executor proposed at the end of the row's last step and returned with its outputs:
        ``_grammar_drafts``); bias entries apply at every position by its output index, and logprob rows are
        scored at every position (``_ExtrasAt``)."""
        nd, r = meta.num_decode, meta.num_sampled
        spec, verify = self.spec, step.verify
        width = verify.width if nd else 1
        if width == 1:  # one token a row: the plain sampler (extras included), then the bookkeeping
            if nd:
                step.sampling.step[:nd] = verify.sample_steps
            out = self.sample(meta, step, logits, t_sample)
            tokens, finite = out.token_ids, out.finite
            counts = (0, 0, 0)
            if nd:
                counts = self._spec_counts(spec.accept(step.decode_rows, tokens[:nd, None], finite[:nd, None],
                                                       verify.usable_drafts))
            self._start_and_propose(meta, step, tokens[nd:])
            out.token_ids, out.spec_counts = tokens[:, None], counts
            out.num_emitted = torch.ones(r, dtype=torch.int64, device=self.device)
            out.grammar_drafts, out.grammar_num_drafts = self._grammar_drafts(meta, step)
            return out
        nt = step.num_decode_tokens
        rows, expand = step.decode_rows, _expand_decode(nd, width)
        st = step.sampling
        steps = torch.cat([verify.sample_steps, st.step[nd:]])  # [T] each position's output index
        # Every position gets its row's parameters; an all-greedy step's argmax reads none of them (``sample``), so
        # there only the steps are laid out (the bias windows read them): ~16 tensor operations fewer a step.
        sampling = st if meta.all_greedy else SamplingTensors(
            temperature=expand(st.temperature), top_k=expand(st.top_k), top_p=expand(st.top_p), min_p=expand(st.min_p),
            seed=expand(st.seed), step=steps)
        prompt = self._prompt_logprobs(meta, step, logits[nt + r - nd:])
        logits = logits[:nt + r - nd]
        extras = _ExtrasAt(meta, step, (nd, width, nt))
        raw_logprobs = extras.raw_logprobs(logits)
        drafts = spec.drafts.index_select(0, rows)[:, :width - 1]  # [D, W - 1]
        with mark("sample", meta.step_id):
            penalty = step.penalty
            if penalty is not None:
                self._update_penalty_context(meta, step.batch, penalty, nt)
                logits = torch.cat([
                    self.penalties.apply_with_drafts(logits[:nt], rows, drafts, expand(penalty.presence)[:nt],
                                                     expand(penalty.frequency)[:nt], expand(penalty.repetition)[:nt]),
                    self.penalties.apply(logits[nt:], step.sample_rows[nd:], penalty.presence[nd:],
                                         penalty.frequency[nd:], penalty.repetition[nd:])])
            logits = self._bias_and_mask(meta, logits, steps, extras, copied=penalty is not None, wait_for_mask=True)
            result = sample(logits, sampling, all_greedy=meta.all_greedy, any_top_k_top_p_min_p=meta.any_filter)
            chosen = extras.chosen_logprobs(raw_logprobs, result.token_ids)
            verified = spec.accept(rows, result.token_ids[:nt].view(nd, width), result.finite[:nt].view(nd, width),
                                   verify.usable_drafts)
            emitted = verified.num_emitted
            prefill_tokens = result.token_ids[nt:]
            if penalty is not None:
                kept = torch.arange(width, device=self.device)[None, :] < emitted[:, None]  # [D, W]
                self.penalties.record(rows.repeat_interleave(width), verified.tokens.reshape(-1), kept.reshape(-1))
                self.penalties.record(step.sample_rows[nd:], prefill_tokens)
            self.token_buffer[rows] = verified.tokens.gather(1, (emitted - 1)[:, None]).squeeze(1)
            self.token_buffer[step.sample_rows[nd:]] = prefill_tokens
            self._start_and_propose(meta, step, prefill_tokens)
            tokens = torch.zeros(r, width, dtype=torch.int64, device=self.device)
            tokens[:nd] = verified.tokens
            tokens[nd:, 0] = prefill_tokens
            num_emitted = torch.cat([emitted, torch.ones(r - nd, dtype=torch.int64, device=self.device)])
        grammar_drafts, grammar_num_drafts = self._grammar_drafts(meta, step)
        return StepOutcome(tokens, torch.cat([verified.finite, result.finite[nt:]]), t_sample, extras.mask_wait_ms,
                           extras.mask_wait_start, chosen, prompt, num_emitted=num_emitted,
                           spec_counts=self._spec_counts(verified), grammar_drafts=grammar_drafts,
                           grammar_num_drafts=grammar_num_drafts)

    def _start_and_propose(self, meta: StepMeta, step: DeviceStep, prefill_tokens: torch.Tensor) -> None:
        """The rows whose prefill ended start decoding (``prefill_tokens``: their first outputs, in sample order
        after the decode rows); then every sampled row drafts its next step by n-gram (the planner thread does not
        wait: this runs on the device's side of the step)."""
        nd, nt, r = meta.num_decode, step.num_decode_tokens, meta.num_sampled
        batch = step.batch
        if r > nd:
            last = batch.logits_indices[nt:nt + r - nd]  # [P] each prefill row's last token
            self.spec.start_rows(step.sample_rows[nd:], batch.positions.index_select(0, last) + 1,
                                 step.sampling.step[nd:r] + 1, prefill_tokens)
        if self.draft is None:  # a draft model proposes at the start of the step that verifies (``draft_model``)
            self.spec.propose(step.sample_rows)

    def _grammar_drafts(self, meta: StepMeta, step: DeviceStep) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The drafts the step's grammar rows proposed for their next verify (``StepResult.grammar_drafts``): the
        host fills that step's masks along them. None without grammar rows, or with a draft model (its drafts
        are made in the step that checks them, and offered to the host there: ``GrammarMask.device_drafts``)."""
        if self.draft is not None or meta.extras is None or meta.extras.grammar is None:
            return None, None
        return self._grammar_rows_drafts(step)

    def _grammar_rows_drafts(self, step: DeviceStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts the device holds for the step's grammar rows: ``[G, k]`` and their counts ``[G]``."""
        rows = step.sample_rows.index_select(0, step.extras.grammar_index)
        return self.spec.drafts.index_select(0, rows), self.spec.num_drafts.index_select(0, rows)

    @staticmethod
    def _spec_counts(verified: Verified) -> tuple[int, int, int]:
        return verified.num_drafts, verified.num_draft_tokens, verified.num_accepted

    @staticmethod
    def _wait_for_mask(meta: StepMeta) -> tuple[float, float]:
        """Block until the step's grammar mask is filled; (when the wait began, milliseconds waited)."""
        grammar = meta.extras.grammar
        t0 = time.perf_counter()
        if grammar.ready:
            return t0, 0.0
        with mark("grammar_mask_wait", meta.step_id):
            grammar.wait_ready()
        return t0, (time.perf_counter() - t0) * 1e3

    def _apply_mask(self, logits: torch.Tensor, grammar: GrammarMask, index: torch.Tensor,
                    mask_rows: torch.Tensor | None, unbiased: torch.Tensor | None = None) -> None:
        """``grammar``'s bitmask rows ``mask_rows`` (None: all, in order) on logits rows ``index``; a row the
        mask and the bias together leave empty takes ``unbiased`` ``[E, V]`` (its logits before the bias)
        under the mask alone (``_bias_and_mask``). No host synchronisation: a select, not a branch."""
        bitmask = torch.from_numpy(grammar.bitmask)  # [M, words] int32; filled and final once ready
        if self.device.type != "cpu":
            bitmask = bitmask.to(self.device, non_blocking=True)  # pinned by CudaExecutor.masks_ready
        if mask_rows is not None:
            bitmask = bitmask.index_select(0, mask_rows)
        rows = logits.index_select(0, index)  # [E, V]
        apply_bitmask_(rows, bitmask)
        if unbiased is not None:
            apply_bitmask_(unbiased, bitmask)
            empty = torch.isneginf(rows).all(dim=1, keepdim=True)  # [E, 1]
            rows = torch.where(empty, unbiased, rows)
        logits.index_copy_(0, index, rows)

    def _update_penalty_context(self, meta: StepMeta, batch: ForwardBatch, penalty: PenaltyInputs,
                                num_decode_tokens: int | None = None) -> None:
        if meta.first_chunk_rows:
            self.penalties.reset_rows(penalty.first_chunk_rows)
        if penalty.cached_context is not None:  # after the reset: these rows' first chunks are in this step
            self.penalties.add_context(*penalty.cached_context)
        nd = meta.num_decode if num_decode_tokens is None else num_decode_tokens
        if len(batch.input_ids) > nd:
            self.penalties.add_context(penalty.token_owner_row[nd:], batch.input_ids[nd:],
                                       penalty.token_is_output[nd:])

    def memory_info(self) -> dict:
        """``weights_mib``, ``kv_cache_mib`` (a draft model's included) and the weights' precision, for the
        executors' ``describe``."""
        models = [(self.model, self.kv_caches)] + ([] if self.draft is None else [(self.draft.model,
                                                                                   self.draft.kv_caches)])
        return {"weights_mib": sum(module_mib(m) + packed_bytes(m) / 2**20 for m, _ in models),
                "kv_cache_mib": tensor_mib(t for _, caches in models for kv in caches for t in kv),
                "dtype": str(self.model.model.embed_tokens.weight.dtype).removeprefix("torch."),
                "quantization": self.model.quantization}


class TorchExecutor(ThreadedExecutor):
    """The ``cpu`` backend: a ``TorchStep`` run on a ``DeviceThread``.

    ``compile_decode``: pure decode steps run the model compiled by ``torch.compile``
    (``model.compiled_decode``), compiled here before the first request (minutes on a small CPU).
    ``num_threads``: the kernel threads of the device thread, the only engine thread that runs kernels on more
    than one (``kernel_threads``: the compile warm-up runs there too, and compiled kernels keep the count they
    were compiled with); None leaves torch's count as it is.
    """

    is_cuda = False

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_num_seqs: int,
                 device: torch.device, dtype_choice: str | None = None, compile_decode: bool = False,
                 speculative: SpeculativeConfig | None = None, max_model_len: int = 0,
                 draft: DraftModel | None = None, num_threads: int | None = None) -> None:
        device = torch.device(device)
        self.dtype_choice = dtype_choice
        if device.type != "cpu":
            raise ValueError(f"TorchExecutor runs on the CPU; use CudaExecutor for {device}")
        self._torch_step = TorchStep(model, kv_caches, max_num_seqs, device, speculative=speculative,
                                     max_model_len=max_model_len, draft=draft)
        self.model, self.kv_caches, self.token_buffer = model, kv_caches, self._torch_step.token_buffer
        self.device = device
        self.name = device.type
        self.forward_hook: Callable[[StepMeta], None] | None = None  # tests inject faults here
        self._thread = DeviceThread("asyncbatch-device", self._run_threaded, on_start=None if num_threads is None
                                    else partial(claim_kernel_threads, num_threads))
        self.kernel_threads = self._thread.call(torch.get_num_threads)
        self.compile_seconds: float | None = None
        if compile_decode:
            self._torch_step.decode_forward = CompiledDecode(model, kv_caches)
            try:
                self.compile_seconds = self._thread.call(self._torch_step.decode_forward.warm_up)
            except BaseException:
                self._thread.stop()  # no engine will close this executor: its thread must not outlive it
                raise

    def _copy_in(self, meta: StepMeta) -> DeviceStep:
        return self._torch_step.copy_in(meta)

    def _compute(self, meta: StepMeta, step: DeviceStep) -> StepOutcome:
        return self._torch_step.compute(meta, step, self.forward_hook)

    def _run_threaded(self, meta: StepMeta, handle: StepHandle) -> StepResult:
        torch.set_grad_enabled(False)
        t0 = time.perf_counter()
        with mark("h2d", meta.step_id):
            step = self._copy_in(meta)
        meta.staging.fence.signal()
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = self._compute(meta, step)
        t2 = time.perf_counter()
        with mark("d2h", meta.step_id):
            out_tokens, out_finite = out.token_ids.numpy().copy(), out.finite.numpy().copy()
            num_emitted = None if out.num_emitted is None else out.num_emitted.numpy().copy()
            drafts = None if out.grammar_drafts is None else out.grammar_drafts.numpy().copy()
            num_drafts = None if out.grammar_num_drafts is None else out.grammar_num_drafts.numpy().copy()
            logprobs = None if out.logprobs is None else out.logprobs.to_host()
            prompt = None if out.prompt_logprobs is None else out.prompt_logprobs.to_host()
        t3 = time.perf_counter()
        return StepResult(meta.step_id, out_tokens, out_finite, device_start=t0, device_end=t2,
                          h2d_ms=(t1 - t0) * 1e3, forward_ms=(out.sample_start - t1) * 1e3,
                          sample_ms=(t2 - out.sample_start) * 1e3 - out.mask_wait_ms, d2h_ms=(t3 - t2) * 1e3,
                          mask_wait_ms=out.mask_wait_ms, mask_wait_start=out.mask_wait_start,
                          logprobs=logprobs, prompt_logprobs=prompt, num_emitted=num_emitted,
                          spec_counts=out.spec_counts, grammar_drafts=drafts, grammar_num_drafts=num_drafts)

    def describe(self) -> dict:
        return {**super().describe(), **self._torch_step.memory_info(), "dtype_choice": self.dtype_choice,
                "torch_threads": self.kernel_threads,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "compile_decode": self.compile_seconds is not None, "compile_seconds": self.compile_seconds,
                "compiled_steps": self._torch_step.compiled_steps,
                # Decoder linears multiplying through oneDNN's packed weights (``packed_linears``), and of those the
                # ones whose one- and two-row steps go through fbgemm's float16-weight kernel (``fp16_kernel``).
                "packed_linears": sum(isinstance(m, PackedLinear) for m in self.model.modules()),
                "fp16_kernel_linears": sum(isinstance(m, PackedLinear) and m.fp16 is not None
                                           for m in self.model.modules()),
                # The most decode rows a step may have to take the lean CPU step (``lean_step.lean_max_rows``; 0:
                # the model runs without it).
                "lean_max_rows": self.model.lean_max_rows}
