"""Verification of deterministic drafts (n-gram, or a greedy draft model) by the target's own sampler.

A row proposes drafts ``d_1 .. d_m`` (``m = num_drafts <= k``); the target's forward over its last token and
the drafts gives logits at ``k + 1`` positions, and the sampler draws one token per position with the row's
seed at steps ``step, step + 1, ... step + k`` (``sampling.sampler.sample``), each position's penalties
seeing the drafts before it as outputs. ``accept_drafts`` keeps the drafts while the sample at the position
before each equals it, then the first sample that differs (or the sample after the last draft):
``num_accepted + 1`` tokens, at least one.

Why this is exact. The sampler's noise is a function of ``(seed, step)`` only, so the sample at position
``j`` is the token non-speculative decoding would sample at that step whenever the drafts before it were
accepted, i.e. whenever its prefix is the one non-speculative decoding would have had. Hence the emitted
tokens are *identical* to non-speculative decoding with the same seed (greedy rows included), not only
equal in distribution. For a draft that is a single token ``x`` (probability 1 under the drafter) this is
the standard rejection rule: ``x`` is accepted with probability ``p(x)``, and after a rejection the token
is distributed as ``p`` without ``x``. A stochastic draft model needs the ``p / q`` rule instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Accepted(NamedTuple):
    tokens: torch.Tensor  # [R, k + 1] int64: the emitted tokens first, 0 after them
    num_emitted: torch.Tensor  # [R] int64: num_accepted + 1
    num_accepted: torch.Tensor  # [R] int64: drafts kept


def accept_drafts(samples: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> Accepted:
    """``samples`` ``[R, k + 1]`` (the target's token at each position), ``drafts`` ``[R, k]`` and
    ``num_drafts`` ``[R]`` (``ngram.ngram_propose``) -> ``Accepted``. Static shapes, no host round trip."""
    k = drafts.shape[1]
    if samples.shape != (drafts.shape[0], k + 1):
        raise ValueError(f"samples must be [R, k + 1] = {[drafts.shape[0], k + 1]}, got {list(samples.shape)}")
    positions = torch.arange(k + 1, device=samples.device)  # [k + 1]
    match = (samples[:, :k] == drafts) & (positions[None, :k] < num_drafts[:, None])  # [R, k]
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R] the leading run of matches
    num_emitted = num_accepted + 1
    tokens = torch.where(positions[None, :] < num_emitted[:, None], samples, 0)
    return Accepted(tokens, num_emitted, num_accepted)
