"""Draft verification by the target's seeded sampler gives exactly the tokens of non-speculative decoding.

The "model" is a fixed random Markov chain over a small vocabulary (the logits of the next token depend on
the last token only), so both decoders can be run step by step here; drafts come from the n-gram proposer
over the row's history and, to exercise rejections, from a drafter that is often wrong.
"""

from __future__ import annotations

import pytest
import torch

from asyncbatch.sampling.sampler import SamplingTensors, sample
from asyncbatch.speculative.ngram import ngram_propose
from asyncbatch.speculative.verify import accept_drafts

VOCAB, K = 12, 4


def chain(seed: int) -> torch.Tensor:
    """[VOCAB, VOCAB] logits of the next token given the last; peaked so that n-grams repeat."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=gen) * 3.0


def tensors(rows: int, temperature: float, seeds: list[int], steps: torch.Tensor) -> SamplingTensors:
    return SamplingTensors(temperature=torch.full((rows,), temperature), top_k=torch.zeros(rows, dtype=torch.int64),
                           top_p=torch.ones(rows), min_p=torch.zeros(rows),
                           seed=torch.tensor(seeds, dtype=torch.int64), step=steps)


def plain(logits_of: torch.Tensor, prompts: list[list[int]], n: int, temperature: float, seeds: list[int]):
    """Non-speculative: one token per row per step."""
    out = [list(p) for p in prompts]
    for step in range(n):
        last = torch.tensor([o[-1] for o in out])
        st = tensors(len(out), temperature, seeds, torch.full((len(out),), step, dtype=torch.int64))
        for o, t in zip(out, sample(logits_of[last], st).token_ids.tolist()):
            o.append(t)
    return [o[len(p):] for o, p in zip(out, prompts)]


def speculative(logits_of: torch.Tensor, prompts: list[list[int]], n: int, temperature: float, seeds: list[int],
                drafter: str) -> tuple[list[list[int]], int]:
    """Each round: drafts, the target's sample at all k + 1 positions (step + j), accept, append."""
    rows = len(prompts)
    out = [list(p) for p in prompts]
    produced = [0] * rows
    accepted_total = 0
    gen = torch.Generator().manual_seed(7)
    while min(produced) < n:
        width = max(len(o) for o in out) + 1
        history = torch.zeros(rows, width, dtype=torch.int64)
        for i, o in enumerate(out):
            history[i, :len(o)] = torch.tensor(o)
        lengths = torch.tensor([len(o) for o in out])
        if drafter == "ngram":
            drafts, counts = ngram_propose(history, lengths, K, 1, 3)
        else:  # a drafter that is right about a third of the time
            drafts = torch.randint(0, VOCAB, (rows, K), generator=gen)
            counts = torch.full((rows,), K, dtype=torch.int64)
        # Inputs of the k + 1 positions: the last token, then the drafts (what the verify forward reads).
        inputs = torch.cat([history.gather(1, (lengths - 1)[:, None]), drafts], dim=1)  # [R, k + 1]
        steps = torch.tensor(produced, dtype=torch.int64)[:, None] + torch.arange(K + 1)  # [R, k + 1]
        st = tensors(rows * (K + 1), temperature, [s for s in seeds for _ in range(K + 1)], steps.reshape(-1))
        samples = sample(logits_of[inputs.reshape(-1)], st).token_ids.view(rows, K + 1)
        result = accept_drafts(samples, drafts, counts)
        accepted_total += int(result.num_accepted.sum())
        for i in range(rows):
            emitted = result.tokens[i, :int(result.num_emitted[i])].tolist()
            out[i] += emitted
            produced[i] += len(emitted)
    return [o[len(p):len(p) + n] for o, p in zip(out, prompts)], accepted_total


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("drafter", ["ngram", "often-wrong"])
def test_speculative_tokens_equal_plain_tokens(temperature, drafter):
    logits_of = chain(3)
    prompts = [[1, 2, 3, 1, 2], [4, 4, 4], [5, 6, 7, 8, 5, 6], [9], [2, 3, 2, 3, 2]]
    seeds = [11, 12, 13, 14, 15]
    want = plain(logits_of, prompts, 40, temperature, seeds)
    got, accepted = speculative(logits_of, prompts, 40, temperature, seeds, drafter)
    assert got == want
    assert accepted > 0  # drafts were accepted, so the equality is not one token at a time


def test_accept_drafts_keeps_the_leading_matches_and_one_more():
    samples = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 2, 3], [5, 6, 7]])
    counts = torch.tensor([3, 3, 3, 1])
    r = accept_drafts(samples, drafts, counts)
    assert r.num_accepted.tolist() == [3, 1, 0, 1]
    assert r.num_emitted.tolist() == [4, 2, 1, 2]
    assert r.tokens.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0], [1, 0, 0, 0], [5, 6, 0, 0]]
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_drafts(samples[:, :3], drafts, counts)
