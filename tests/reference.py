"""Greedy reference from transformers, with the near-tie rule of the acceptance criteria.

A divergence from ``generate(do_sample=False)`` is accepted only where the
reference's own top two logits at that position are closer than ``TIE_GAP``;
the caller counts those and reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TIE_GAP = 1e-4


@dataclass
class GreedyComparison:
    exact: int = 0
    near_ties: list[tuple[int, int, float]] = field(default_factory=list)  # (request, position, gap)

    def summary(self) -> str:
        return f"{self.exact} identical, {len(self.near_ties)} diverged at a near-tie {self.near_ties}"


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id if eos_token_id is not None else 0,
                             temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


def top2_gap(model, token_ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare_greedy(model, prompts: list[list[int]], ours: list[list[int]], max_tokens: list[int],
                   eos_token_id: int | None, cache: dict | None = None) -> GreedyComparison:
    """``cache`` (optional, keyed by prompt and length) keeps the reference's tokens for another run of the
    same requests against the same model (overlap and synchronous mode compare against one reference)."""
    result = GreedyComparison()
    for i, (prompt, got, n) in enumerate(zip(prompts, ours, max_tokens)):
        key = (tuple(prompt), n)
        ref = cache.get(key) if cache is not None else None
        if ref is None:
            ref = reference_greedy(model, prompt, n, eos_token_id)
            if cache is not None:
                cache[key] = ref
        if got == ref:
            result.exact += 1
            continue
        k = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        assert k < min(len(got), len(ref)), (
            f"request {i}: lengths differ without a token divergence: ours {len(got)} vs reference {len(ref)}")
        gap = top2_gap(model, prompt + ref[:k])
        assert gap < TIE_GAP, f"request {i} diverges at output {k} where the reference's top-2 gap is {gap:.3g}"
        result.near_ties.append((i, k, gap))
    return result
