"""Log-probabilities of chosen tokens and their top alternatives, on the device, as columns.

Computed from the model's raw logits (before penalties, ``logit_bias``,
grammar masks, temperature and the top-k/top-p/min-p filters), which is vLLM's
default ``raw_logprobs``: a token's logprob says what the model thought of it,
not what the sampler was allowed to pick. Only the rows that asked are computed
(``[L, V]`` for L such rows), so a step without logprob rows costs nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class TokenLogprobs(NamedTuple):
    """Per scored position: the token's logprob and rank, and the ``k`` best (all ``[N]`` / ``[N, k]``)."""

    chosen: torch.Tensor | np.ndarray  # [N] float32
    ranks: torch.Tensor | np.ndarray  # [N] int64, 1 = the most likely token
    top_ids: torch.Tensor | np.ndarray  # [N, k] int64, most likely first
    top_logprobs: torch.Tensor | np.ndarray  # [N, k] float32

    def to_host(self) -> TokenLogprobs:
        """numpy copies (blocks until the device computed them)."""
        return TokenLogprobs(*(t.cpu().numpy() for t in self))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> TokenLogprobs:
    """Logprobs of ``token_ids`` ``[N]`` under ``logits`` ``[N, V]`` float32 (not modified), with the top ``k``.

    The rank counts tokens strictly more likely than the chosen one, plus one (vLLM's rank). Ties in the top
    ``k`` come out in ``torch.topk``'s order.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logprobs.gather(1, token_ids.long()[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [N, k]
    else:
        top_logprobs = logprobs.new_zeros(logits.shape[0], 0)
        top_ids = torch.zeros(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    return TokenLogprobs(chosen.squeeze(1), ranks, top_ids, top_logprobs)

