"""Repetition, presence and frequency penalties, with per-row token state on device.

Semantics follow vLLM: repetition applies to every token of the prompt or the output
so far, presence and frequency to output tokens only. State is kept per token row in
two dense device tensors (``seen`` ``[num_rows, V]`` bool, ``counts`` ``[num_rows, V]``
int32), allocated on first use.

Invariant: for a row holding a request, ``seen`` is exactly the set of tokens of its
prompt plus the outputs recorded so far, and ``counts`` is the multiset of those
outputs; ``reset_rows`` + ``add_context`` after preemption rebuild what incremental
``record`` calls built. After the first use (which the caller makes outside CUDA-graph
capture) every method is capture-safe: no host syncs, fixed shapes.

Specification: docs/sampling.md ("Penalties")
"""

from __future__ import annotations

import torch


class PenaltyState:
    """Per-row prompt/output token statistics and the penalties computed from them."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        if num_rows < 1 or vocab_size < 1:
            raise ValueError(f"num_rows and vocab_size must be >= 1, got {num_rows}, {vocab_size}")
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._seen_flat: torch.Tensor | None = None  # [num_rows * V + 1] bool
        self._counts: torch.Tensor | None = None  # [num_rows, V] int32

    @property
    def allocated(self) -> bool:
        return self._counts is not None

    @property
    def seen(self) -> torch.Tensor:
        """``[num_rows, V]`` bool: prompt or output tokens per row (allocates)."""
        return self._state()[0][:-1].view(self.num_rows, self.vocab_size)

    @property
    def counts(self) -> torch.Tensor:
        """``[num_rows, V]`` int32: output token counts per row (allocates)."""
        return self._state()[1]

    def _state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seen_flat, counts)``; ``seen_flat`` ``[num_rows * V + 1]`` ends in a sink
        entry that absorbs the writes of rows that must not count."""
        if self._seen_flat is None or self._counts is None:
            size = self.num_rows * self.vocab_size
            self._seen_flat = torch.zeros(size + 1, dtype=torch.bool, device=self.device)
            self._counts = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
        return self._seen_flat, self._counts

    def _flat_index(self, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return rows.to(torch.int64) * self.vocab_size + token_ids.to(torch.int64)  # [N]

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Forget everything about ``rows`` ``[K]`` (a request was admitted or resumed)."""
        _, counts = self._state()
        self.seen.index_fill_(0, rows, False)
        counts.index_fill_(0, rows, 0)

    def add_context(self, rows: torch.Tensor, token_ids: torch.Tensor, is_output: torch.Tensor) -> None:
        """Account for the tokens of a prefill chunk, one entry per token, all ``[N]``.

        Every token is marked seen; those with ``is_output`` (former outputs of a
        recomputed request) also count as outputs.
        """
        seen_flat, counts = self._state()
        index = self._flat_index(rows, token_ids)  # [N]
        # Duplicates all write True, so the unordered scatter is still deterministic.
        seen_flat.index_fill_(0, index, True)
        counts.view(-1).index_add_(0, index, is_output.to(torch.int32))

    def record(self, rows: torch.Tensor, sampled: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add the freshly sampled tokens ``sampled`` ``[R]`` to the outputs of ``rows`` ``[R]``.

        ``valid`` ``[R]`` bool, when given, leaves rows that are False untouched (padding
        rows, or rows whose sample was not finite and will be discarded).
        """
        seen_flat, counts = self._state()
        index = self._flat_index(rows, sampled)  # [R]
        if valid is None:
            increment = torch.ones_like(index, dtype=torch.int32)  # [R]
        else:
            # Invalid rows write their True into the sink and add 0: no branch on device values.
            index = torch.where(valid, index, seen_flat.numel() - 1)
            increment = valid.to(torch.int32)
        seen_flat.index_fill_(0, index, True)
        # The sink is one past the end of counts; there it adds its 0 to the last entry.
        counts.view(-1).index_add_(0, index.clamp(max=counts.numel() - 1), increment)

    def apply(
        self, logits: torch.Tensor, rows: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
        repetition: torch.Tensor,
    ) -> torch.Tensor:
        """Return ``logits`` ``[R, V]`` penalised with the state of ``rows`` ``[R]``.

        ``presence``, ``frequency`` and ``repetition`` are ``[R]`` in ``logits``' dtype;
        rows with 0, 0 and 1 come back unchanged. ``logits`` is not modified.
        """
        _, counts = self._state()
        row_seen = self.seen.index_select(0, rows)  # [R, V] bool
        row_counts = counts.index_select(0, rows).to(logits.dtype)  # [R, V]
        return _penalise(logits, row_seen, row_counts, presence, frequency, repetition)

    def apply_with_drafts(
        self, logits: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor, presence: torch.Tensor,
        frequency: torch.Tensor, repetition: torch.Tensor,
    ) -> torch.Tensor:
        """``apply`` for a verify step: ``logits`` ``[D * W, V]`` are row ``i``'s ``W`` positions (``rows`` ``[D]``),
        and position ``j`` sees drafts ``drafts[i, :j]`` (``[D, W - 1]``) as outputs, as non-speculative
        decoding would have seen them had they been sampled. ``presence`` etc. are ``[D * W]``."""
        _, counts = self._state()
        num_rows, width = drafts.shape[0], drafts.shape[1] + 1
        row_seen = self.seen.index_select(0, rows).repeat_interleave(width, 0)  # [D * W, V]
        row_counts = counts.index_select(0, rows).to(logits.dtype).repeat_interleave(width, 0)  # [D * W, V]
        if width > 1:
            positions = torch.arange(width, device=rows.device)
            sees = positions[:, None] > positions[None, :-1]  # [W, W - 1]: position j sees draft m < j
            i, j, m = sees.expand(num_rows, -1, -1).nonzero(as_tuple=True)  # [N] each
            flat, token = i * width + j, drafts[i, m]
            row_counts.index_put_((flat, token), torch.ones_like(flat, dtype=logits.dtype), accumulate=True)
            row_seen[flat, token] = True
        return _penalise(logits, row_seen, row_counts, presence, frequency, repetition)


def _penalise(logits: torch.Tensor, row_seen: torch.Tensor, row_counts: torch.Tensor, presence: torch.Tensor,
              frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """The penalties of rows with ``row_seen`` ([R, V] bool) and ``row_counts`` ([R, V] in the logits' dtype)."""
    rep = repetition.to(logits.dtype)[:, None]  # [R, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # [R, V]
    out = torch.where(row_seen, penalised, logits)
    out -= frequency.to(logits.dtype)[:, None] * row_counts
    out -= presence.to(logits.dtype)[:, None] * (row_counts > 0).to(logits.dtype)
    return out
