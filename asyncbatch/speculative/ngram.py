"""Prompt-lookup (n-gram) proposals for a batch of rows, as tensor operations: no host round trip.

For each row with ``lengths[r]`` known tokens ``history[r, :lengths[r]]``, the proposal is what vLLM's
``method="ngram"`` proposes: the longest suffix of ``n`` tokens, ``prompt_lookup_min <= n <=
prompt_lookup_max``, that also occurs earlier in the row (a window ``[s, s + n)`` with ``s + n <= length -
1``, so at least one token follows it; overlapping the suffix is allowed), at its earliest such ``s``; the
draft is the up to ``k`` tokens after that occurrence, ``history[r, s + n : s + n + k]``, cut at the row's
end and at ``max_model_len - length`` (a row never drafts past the model's length). A row without a match
drafts nothing.

Every shape is static (``[R, k]`` drafts, ``[R]`` counts), so the function runs inside a captured CUDA
graph or a compiled step as well as eagerly, on whatever device ``history`` lives on. Cost: for each ``n``,
``n`` comparisons of the ``[R, L]`` history with a column: O(R * L * sum(n)) element operations, a few
microseconds of a GPU; on the CPU it is measured with the step it belongs to.
"""

from __future__ import annotations

import torch


def ngram_propose(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int,
                  max_model_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``history`` ``[R, L]`` int64 token ids (entries past a row's length are ignored), ``lengths`` ``[R]``
    int64 -> (``drafts`` ``[R, k]`` int64, ``num_drafts`` ``[R]`` int64); ``drafts[r, num_drafts[r]:]`` is 0."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n} and {max_n}")
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    rows, width = history.shape
    device = history.device
    lengths = lengths.to(torch.int64)
    positions = torch.arange(width, device=device)  # [L]
    found = torch.zeros(rows, dtype=torch.bool, device=device)  # [R] some n matched
    start = torch.zeros(rows, dtype=torch.int64, device=device)  # [R] first token after the chosen match
    for n in range(min_n, min(max_n, width - 1) + 1):  # a longer n overrides a shorter one
        windows = width - n  # window starts 0 .. L - n - 1 (at least one token after the window)
        match = (positions[None, :windows] + n <= lengths[:, None] - 1)  # [R, W] starts that may match
        for j in range(n):
            # Token j of the row's n-token suffix, history[r, length - n + j] (0 where the row is shorter).
            column = history.gather(1, (lengths - n + j).clamp(min=0)[:, None])  # [R, 1]
            match &= history[:, j:j + windows] == column
        any_match = match.any(dim=1)  # [R]
        first = torch.where(match, positions[None, :windows], width).amin(dim=1)  # [R] earliest start
        use = any_match & (lengths >= n)
        found |= use
        start = torch.where(use, first + n, start)
    limit = lengths - start  # [R] tokens after the match
    if max_model_len is not None:
        limit = torch.minimum(limit, max_model_len - lengths)
    num_drafts = torch.where(found, limit.clamp(min=0, max=k), 0)  # [R]
    offsets = torch.arange(k, device=device)  # [k]
    take = (start[:, None] + offsets[None, :]).clamp(max=width - 1)  # [R, k]
    drafts = torch.where(offsets[None, :] < num_drafts[:, None], history.gather(1, take), 0)
    return drafts, num_drafts
