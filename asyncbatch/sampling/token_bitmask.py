"""Token bitmasks: the allowed-token sets of grammar rows, 32 tokens per int32 word.

Bit ``t % 32`` of word ``t // 32`` is 1 when token ``t`` is allowed (the layout
xgrammar and llguidance fill). Applying a mask sets every disallowed logit to
-inf, so the sampler can only pick allowed tokens and a row with nothing
allowed comes out non-finite (and ends with an error, never a wrong token).
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """Words per row for a vocabulary of ``vocab_size`` tokens."""
    return -(-vocab_size // 32)


def bits_set(bitmask: np.ndarray, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Whether row ``rows[i]`` of a host ``bitmask`` (int32 ``[R, W]``) allows ``tokens[i]``, as a bool array;
    a token outside the mask's ``W * 32`` ids (or negative) is not allowed."""
    words = tokens >> 5
    inside = (tokens >= 0) & (words < bitmask.shape[1])
    bits = (bitmask[rows, np.where(inside, words, 0)] >> (tokens & 31)) & 1
    return inside & (bits != 0)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf in place.

    ``logits`` ``[G, V]`` float on any device, ``bitmask`` int32 ``[G, W]`` with ``W >= ceil(V / 32)`` on
    the same device. Pure torch (shape checks only on the host, no synchronisation); works for any ``V``.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [G, V] and bitmask [G, W] need the same G, got {tuple(logits.shape)} "
                         f"and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
    rows, vocab = logits.shape
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row, {bitmask_words(vocab)} needed for "
                         f"{vocab} logits")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    blocked = ((bitmask.unsqueeze(-1) >> shifts) & 1) == 0  # [G, W, 32] bool
    logits.masked_fill_(blocked.view(rows, -1)[:, :vocab], float("-inf"))
