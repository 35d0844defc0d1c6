"""What a speculative engine's device holds per token row, and the verify step's work on it.

The planner runs one step ahead: when it plans step N+1 it does not know how many tokens step N accepted
for a row, so it cannot say where the row's next input goes. The device knows, so it keeps, per token row:

* ``length``: the position of the row's next input token (its tokens with computed KV);
* ``num_outputs``: outputs sampled so far (the seeded sampler's step counter);
* ``history``: the row's tokens by position (prompt, then outputs), which the n-gram proposer reads;
* ``drafts`` / ``num_drafts``: the drafts its next verify checks: proposed at the end of the row's last step
  (n-gram, ``propose``), or at the start of the verifying step (a draft model, ``draft_model.DraftModel``);
* ``acceptance``: an exponential average of the share of drafts accepted (the per-row policy).

A decode row's tokens in a step are its input token (the token buffer, as without speculation) and its
``depth`` drafts, at positions ``length .. length + depth``; each is a single-token query attending over the
row's cache up to its own position (``decode_inputs``). After sampling, ``accept`` keeps the drafts the
target's own samples confirm (``verify.accept_drafts``) and advances the row; ``propose`` drafts the next
step's tokens on the device (n-gram; a draft model proposes at the start of the step that verifies, its
drafts set through ``set_drafts``). A prefill chunk writes its tokens into the history (``write_prefill``), and the
chunk that ends a prefill starts the row (``start_rows``). Nothing here reads the host, so step N+1's inputs
follow from step N's outcome whatever the planner knew when it planned N+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncbatch.speculative.config import SpeculativeConfig
from asyncbatch.speculative.ngram import ngram_propose
from asyncbatch.speculative.verify import accept_drafts

ACCEPTANCE_DECAY = 0.7  # weight of the old average in ``acceptance``: about the last three verify steps


@dataclass(slots=True)
class DecodeInputs:
    """A step's decode tokens, ``D * (1 + depth)`` of them, row after row."""

    input_ids: torch.Tensor  # [D * W] int64
    positions: torch.Tensor  # [D * W] int64 (< max_model_len: past the reserved KV, clamped)
    slot_mapping: torch.Tensor  # [D * W] int64 (positions past the row's reserved KV write the dummy block)
    context_lens: torch.Tensor  # [D * W] int64, each query's own context
    block_tables: torch.Tensor  # [D * W, max_blocks] int64, each row's table repeated
    usable_drafts: torch.Tensor  # [D] int64 drafts the step can verify (proposed, and within the reserved KV)
    sample_steps: torch.Tensor  # [D * W] int64 the seeded sampler's step of each position

    @property
    def width(self) -> int:
        """Positions computed per row: 1 + the most usable drafts of any row (at most 1 + the planned depth)."""
        return len(self.sample_steps) // len(self.usable_drafts)


@dataclass(slots=True)
class Verified:
    """What a verify step emitted: per row ``tokens[i, :num_emitted[i]]``; the drafts counted for metrics."""

    tokens: torch.Tensor  # [D, W] int64
    num_emitted: torch.Tensor  # [D] int64 in [1, W]
    finite: torch.Tensor  # [D] bool: position 0's logits were finite (else the row errs, one token, dropped)
    num_drafts: int  # rows that verified at least one draft
    num_draft_tokens: int
    num_accepted: int


def query_targets(positions: torch.Tensor, reserved: torch.Tensor, tables: torch.Tensor, block_size: int,
                  dummy_slot: int, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where single-token queries at ``positions`` ``[N, W]`` go, for rows with block tables ``tables`` ``[N, B]``
    and ``reserved`` ``[N]`` reserved KV positions: (the positions to compute, the KV slot each writes, each
    query's context length), ``[N, W]`` each.

    A position at or past the row's reserved KV (a row's own position 0 never is: the planner reserved it) is
    computed and dropped: it writes the dummy slot and attends over itself only; near ``max_model_len`` it may
    lie past the model's rotary table, so it is clamped below it (a row that drafts nothing still spans a
    verify step's width)."""
    inside = positions < reserved[:, None]  # [N, W]
    column = (positions // block_size).clamp(max=tables.shape[1] - 1)  # [N, W]
    slots = torch.where(inside, tables.gather(1, column) * block_size + positions % block_size, dummy_slot)
    computed = torch.where(inside, positions, positions.clamp(max=max_model_len - 1))
    return computed, slots, torch.where(inside, positions + 1, 1)


class SpeculativeState:
    """Per-token-row device state of a speculative engine (``max_num_seqs + 1`` rows: the last one is the
    dummy row of CUDA graph padding, never a request's)."""

    def __init__(self, config: SpeculativeConfig, num_rows: int, max_model_len: int, device: torch.device) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        rows, width = num_rows + 1, max_model_len + config.num_speculative_tokens + 2
        self.length = torch.zeros(rows, dtype=torch.int64, device=device)  # [S + 1]
        self.num_outputs = torch.zeros(rows, dtype=torch.int64, device=device)  # [S + 1]
        self.history = torch.zeros(rows, width, dtype=torch.int64, device=device)  # [S + 1, L']
        self.drafts = torch.zeros(rows, self.k, dtype=torch.int64, device=device)  # [S + 1, k]
        self.num_drafts = torch.zeros(rows, dtype=torch.int64, device=device)  # [S + 1]
        self.acceptance = torch.ones(rows, dtype=torch.float32, device=device)  # [S + 1]

    # -- inputs ---------------------------------------------------------------------------------------
    def decode_inputs(self, rows: torch.Tensor, depth: int, tables: torch.Tensor, reserved: torch.Tensor,
                      token_buffer: torch.Tensor, block_size: int, dummy_slot: int) -> DecodeInputs:
        """``rows`` ``[D]`` token rows, ``tables`` ``[D, B]`` their block tables, ``reserved`` ``[D]`` the KV
        positions the planner reserved for each (positions at or past it are not written).

        The planner planned ``depth`` drafts a row; the step computes only as many positions as the row with
        the most usable drafts needs (``DecodeInputs.width``): a step where no row has a draft is a plain
        decode step. Reading that maximum is a host read of a device value (free on the CPU; a GPU would pad
        to ``depth`` instead)."""
        start = self.length.index_select(0, rows)  # [D]
        usable = torch.minimum(self.num_drafts.index_select(0, rows).clamp(max=depth),
                               (reserved - start - 1).clamp(min=0))  # [D]
        if depth:
            depth = int(usable.max())
        width = depth + 1
        offsets = torch.arange(width, device=rows.device)  # [W]
        positions = start[:, None] + offsets[None, :]  # [D, W]
        ids = token_buffer.index_select(0, rows)[:, None].expand(-1, width).clone()  # [D, W]
        if depth:
            ids[:, 1:] = self.drafts.index_select(0, rows)[:, :depth]
        computed, slots, contexts = query_targets(positions, reserved, tables, block_size, dummy_slot,
                                                  self.max_model_len)  # [D, W] each
        steps = self.num_outputs.index_select(0, rows)[:, None] + offsets[None, :]  # [D, W]
        return DecodeInputs(ids.reshape(-1), computed.reshape(-1), slots.reshape(-1), contexts.reshape(-1),
                            tables.repeat_interleave(width, 0), usable, steps.reshape(-1))

    # -- after sampling -------------------------------------------------------------------------------
    def accept(self, rows: torch.Tensor, samples: torch.Tensor, finite: torch.Tensor,
               usable: torch.Tensor) -> Verified:
        """``samples`` / ``finite`` ``[D, W]``: the target's token at each position. Keeps the confirmed
        drafts, then advances each row (length, outputs, history)."""
        depth = samples.shape[1] - 1
        if not depth:
            # No row verified a draft (a step is one position wide only then, so ``usable`` is all 0): one token
            # a row, emitted even where its logits were not finite (the row errs), and nothing to count.
            one = torch.ones_like(rows)  # [D] tokens emitted
            self._advance_one(rows, samples[:, 0], one)
            return Verified(samples, one, finite[:, 0], 0, 0, 0)
        accepted = accept_drafts(samples, self.drafts.index_select(0, rows)[:, :depth], usable)
        tokens, emitted = accepted.tokens, accepted.num_emitted
        # A position with non-finite logits emits nothing from there on; at position 0 the row errs.
        bad = ~finite  # [D, W]
        first_bad = torch.where(bad.any(dim=1), bad.to(torch.int64).argmax(dim=1), depth + 1)
        emitted = torch.minimum(emitted, first_bad).clamp(min=1)
        self._advance(rows, tokens, emitted)
        drafting = usable > 0
        kept = emitted - 1  # [D] drafts accepted
        share = kept.to(torch.float32) / usable.clamp(min=1).to(torch.float32)
        old = self.acceptance.index_select(0, rows)
        self.acceptance.index_copy_(0, rows, torch.where(drafting, ACCEPTANCE_DECAY * old
                                                         + (1 - ACCEPTANCE_DECAY) * share, old))
        return Verified(tokens, emitted, finite[:, 0], int(drafting.sum()), int(usable.sum()), int(kept.sum()))

    def _advance(self, rows: torch.Tensor, tokens: torch.Tensor, emitted: torch.Tensor) -> None:
        """Row ``i`` got ``tokens[i, :emitted[i]]``: they follow its input token in the history."""
        width = tokens.shape[1]
        start = self.length.index_select(0, rows)  # [D] the input token's position
        offsets = torch.arange(width, device=rows.device)
        keep = offsets[None, :] < emitted[:, None]  # [D, W]
        columns = (start[:, None] + 1 + offsets[None, :]).clamp(max=self.history.shape[1] - 1)
        old = self.history.index_select(0, rows).gather(1, columns)
        self.history.index_put_((rows[:, None].expand(-1, width), columns), torch.where(keep, tokens, old))
        self.length.index_add_(0, rows, emitted)
        self.num_outputs.index_add_(0, rows, emitted)

    def _advance_one(self, rows: torch.Tensor, tokens: torch.Tensor, one: torch.Tensor) -> None:
        """``_advance`` with one token a row (``tokens`` ``[D]``; ``one``: ``[D]`` ones), in about half its
        operations: the step of every row while none has a draft."""
        column = (self.length.index_select(0, rows) + 1).clamp(max=self.history.shape[1] - 1)  # [D]
        self.history.index_put_((rows, column), tokens)
        self.length.index_add_(0, rows, one)
        self.num_outputs.index_add_(0, rows, one)

    def write_prefill(self, owner_rows: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> None:
        """A prefill chunk's tokens (``[N]`` each) into their rows' histories."""
        if len(owner_rows):
            self.history.index_put_((owner_rows, positions), token_ids)

    def start_rows(self, rows: torch.Tensor, next_positions: torch.Tensor, num_outputs: torch.Tensor,
                   tokens: torch.Tensor) -> None:
        """Rows whose prefill ended in this step (``[P]`` each): their first output ``tokens`` (the next input,
        at ``next_positions``) after ``num_outputs - 1`` earlier outputs (a recompute's)."""
        if not len(rows):
            return
        self.length.index_copy_(0, rows, next_positions)
        self.num_outputs.index_copy_(0, rows, num_outputs)
        self.history.index_put_((rows, next_positions), tokens)
        self.acceptance.index_fill_(0, rows, 1.0)

    def propose(self, rows: torch.Tensor) -> None:
        """The next step's drafts of ``rows`` (n-gram lookup over each history up to its newest token). A row whose
        recent acceptance is below ``min_acceptance`` drafts nothing, except every ``retry_every``-th output.

        More rows than ``disable_by_batch_size`` draft nothing: the next step's decode rows are some of these, so
        the planner will not verify drafts there either unless enough of them finish at once, and then those
        rows draft one step later. The lookup is skipped, not wasted on every step of a large batch."""
        if not len(rows):
            return
        limit = self.config.disable_by_batch_size
        if limit is not None and len(rows) > limit:
            self.num_drafts.index_fill_(0, rows, 0)
            return
        lengths = self.length.index_select(0, rows) + 1  # [R] tokens known: through the next input
        width = min(int(lengths.max()), self.history.shape[1])  # the CPU reads this; CUDA would not
        c = self.config
        # The columns first: a row of the history is max_model_len wide, the lookup reads its known tokens only.
        drafts, num = ngram_propose(self.history[:, :width].index_select(0, rows), lengths, self.k,
                                    c.prompt_lookup_min, c.prompt_lookup_max, self.max_model_len)
        self.set_drafts(rows, drafts, torch.where(self.quiet(rows), 0, num))

    def quiet(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R]`` bool: rows that draft nothing now (recent acceptance below ``min_acceptance``, and this
        output is not one of the every-``retry_every`` retries). Both proposers follow it."""
        c = self.config
        retry = self.num_outputs.index_select(0, rows) % c.retry_every == 0
        return (self.acceptance.index_select(0, rows) < c.min_acceptance) & ~retry

    def set_drafts(self, rows: torch.Tensor, drafts: torch.Tensor, num: torch.Tensor) -> None:
        """``drafts`` ``[R, k]`` of which the first ``num`` ``[R]`` count: what each row's next verify checks."""
        self.drafts.index_copy_(0, rows, drafts)
        self.num_drafts.index_copy_(0, rows, num)
