"""Sparse per-row additions to the logits: ``logit_bias``, and the bans of ``min_tokens``.

A step's entries come as three ``[N]`` tensors (row, token, value), one entry per
biased token of a row that asked, so a row without a bias costs nothing and a
bias of a few tokens never builds a ``[R, V]`` tensor. A value of ``-inf`` bans
the token (EOS and stop ids until ``min_tokens`` outputs exist).
"""

from __future__ import annotations

import torch


def apply_sparse_bias_(logits: torch.Tensor, index: torch.Tensor, token_ids: torch.Tensor,
                       values: torch.Tensor) -> None:
    """Add ``values[i]`` to ``logits[index[i], token_ids[i]]`` in place (``logits`` ``[R, V]``, the rest ``[N]``).

    Duplicate (row, token) pairs add up (a bias and a ban on the same token give -inf).
    """
    logits.index_put_((index, token_ids), values.to(logits.dtype), accumulate=True)
