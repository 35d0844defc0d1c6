"""Greedy reference from transformers, with the near-tie rule of the acceptance criteria.

A divergence from ``generate(do_sample=False)`` is accepted only where the
reference's own top two logits at that position are closer than ``TIE_GAP``;
the caller counts those and reports them.

The same rule, with a wider bound, compares two bfloat16 runs of the engine
(``compare_runs_near_tie``): in bfloat16 a row's logits depend on what else is
in its batch and on how its prompt was chunked or cached (docs/reproducibility.md),
so two runs that differ only in scheduling may part where the top two
candidates are within bfloat16's rounding of each other, and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from golden_tokens import request_key

from asyncbatch.executors.kernel_threads import one_kernel_thread

# float32: the engine and transformers sum in different orders; 1e-4 is far above that noise (~1e-6 here)
# and far below a real top-2 gap.
TIE_GAP = 1e-4
# bfloat16 keeps 8 significant bits: a logit of 16-32 (the default model's top logits) is rounded to
# 0.125. The divergences measured between bfloat16 runs that differ only in scheduling were at reference
# gaps of 0.065-0.25 (docs/reproducibility.md); this bound leaves one more such step of margin for other
# CPUs' kernels. Two bfloat16 runs may part only where the bfloat16 reference's top-2 gap is below it:
# 22 % of the default model's greedy positions (54 of the golden workload's 249), so a divergence at a
# position chosen by a bug, not by rounding, fails about four times in five, and several almost surely.
BF16_TIE_GAP = 0.5
# Most sequences of a bfloat16 comparison must be identical from the first token to the last (measured on
# an AVX2 machine with emulated bfloat16: 9 to 18 of 12 to 18 per comparison, docs/reproducibility.md).
BF16_MIN_IDENTICAL = 0.5


class LazyModel:
    """A transformers causal LM loaded on first use (its load is skipped where no gap is ever needed)."""

    def __init__(self, path: str | Path, dtype: str = "float32") -> None:
        self.path, self.dtype = str(path), dtype
        self._model = None

    def get(self):
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).eval()
        return self._model


def _model_of(model):
    return model.get() if isinstance(model, LazyModel) else model


@dataclass
class GreedyComparison:
    exact: int = 0
    near_ties: list[tuple[int, int, float]] = field(default_factory=list)  # (request, position, gap)

    @property
    def total(self) -> int:
        return self.exact + len(self.near_ties)

    def summary(self) -> str:
        return f"{self.exact} identical, {len(self.near_ties)} diverged at a near-tie {self.near_ties}"


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = _model_of(model).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                        pad_token_id=eos_token_id if eos_token_id is not None else 0,
                                        temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


def top2_gap(model, token_ids: list[int]) -> float:
    with torch.no_grad():
        logits = _model_of(model)(torch.tensor([token_ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def first_divergence(i: int, got: list[int], ref: list[int]) -> int | None:
    """The first output position where ``got`` and ``ref`` differ; None where they are equal. Lengths may
    differ only after a divergence (both runs stop on the same rules)."""
    if got == ref:
        return None
    k = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    assert k < min(len(got), len(ref)), (
        f"request {i}: lengths differ without a token divergence: {len(got)} vs {len(ref)} tokens")
    return k


def compare_greedy(model, prompts: list[list[int]], ours: list[list[int]], max_tokens: list[int],
                   eos_token_id: int | None, cache: dict | None = None) -> GreedyComparison:
    """``model``: a transformers model or a ``LazyModel`` (loaded only where a reference must be generated or
    a gap measured). ``cache`` (optional, keyed by ``golden_tokens.request_key``) keeps the reference's tokens
    for another run of the same requests against the same model, and may come pre-filled from the committed
    golden tokens."""
    result = GreedyComparison()
    for i, (prompt, got, n) in enumerate(zip(prompts, ours, max_tokens)):
        key = request_key(prompt, n, eos_token_id)
        ref = cache.get(key) if cache is not None else None
        if ref is None:
            ref = reference_greedy(model, prompt, n, eos_token_id)
            if cache is not None:
                cache[key] = ref
        k = first_divergence(i, got, ref)
        if k is None:
            result.exact += 1
            continue
        gap = top2_gap(model, prompt + ref[:k])
        assert gap < TIE_GAP, f"request {i} diverges at output {k} where the reference's top-2 gap is {gap:.3g}"
        result.near_ties.append((i, k, gap))
    return result


def compare_runs_near_tie(model, prompts: list[list[int]], a: list[list[int]], b: list[list[int]],
                          params: list | None = None, gap_bound: float = BF16_TIE_GAP) -> GreedyComparison:
    """Two runs of the same requests (e.g. overlap vs sync, caching on vs off, in bfloat16): each pair of
    sequences is equal, or equal up to a first divergence at which the reference (``model``, in the runs'
    dtype) puts the two candidates closer than ``gap_bound``: the top-2 logit gap for a greedy row, the gap
    of the two chosen tokens' noisy scores for a seeded random row (``params[i]``; ``sampled_pair_gap``)."""
    result = GreedyComparison()
    for i, (prompt, x, y) in enumerate(zip(prompts, a, b)):
        k = first_divergence(i, x, y)
        if k is None:
            result.exact += 1
            continue
        p = params[i] if params is not None else None
        if p is None or p.temperature == 0.0:
            gap = top2_gap(model, prompt + x[:k])
        else:
            gap = sampled_pair_gap(model, prompt, x[:k], p, (x[k], y[k]))
        assert gap < gap_bound, (f"request {i} diverges at output {k} ({x[k]} vs {y[k]}) where the reference's "
                                 f"gap is {gap:.3g} >= {gap_bound}")
        result.near_ties.append((i, k, gap))
    return result


def assert_mostly_identical(result: GreedyComparison, min_fraction: float = BF16_MIN_IDENTICAL) -> None:
    assert result.exact >= min_fraction * result.total, result.summary()


def assert_bfloat16_runs_agree(model_path, label: str, prompts: list[list[int]], a: list[list[int]],
                               b: list[list[int]], params: list | None = None) -> GreedyComparison:
    """The bfloat16 variants' whole check: ``compare_runs_near_tie`` against the bfloat16 reference at
    ``model_path``, printed (``pytest -s``), and most sequences identical."""
    result = compare_runs_near_tie(LazyModel(model_path, "bfloat16"), prompts, a, b, params)
    print(f"bfloat16 {label}: {result.summary()}")
    assert_mostly_identical(result)
    return result


def sampled_pair_gap(model, prompt: list[int], outputs: list[int], params, pair: tuple[int, int]) -> float:
    """For a seeded random row that two runs sampled differently at output ``len(outputs)``: how far apart
    the two chosen tokens' scores are in the reference, ``|score[a] - score[b]|`` with ``score = penalised
    logits + T * gumbel(seed, step)`` (the sampler's own counter-based noise, docs/sampling.md). A token
    the reference's top-k / top-p leave out adds how far its logit is below the kept threshold, so a
    divergence at the edge of the kept set is a near-tie too. Greedy rows use ``top2_gap``."""
    from asyncbatch.sampling.penalties import PenaltyState
    from asyncbatch.sampling.sampler import neg_gumbel_from_words_, noise_words, row_keys

    assert params.seed is not None, "a random row's divergence is judged only where its noise is seeded"
    with torch.no_grad():
        logits = _model_of(model)(torch.tensor([prompt + outputs])).logits[0, -1:].float()  # [1, V]
    vocab = logits.shape[1]
    state = PenaltyState(1, vocab, logits.device)
    row = torch.zeros(1, dtype=torch.int64)
    state.add_context(row.expand(len(prompt)), torch.tensor(prompt), torch.zeros(len(prompt), dtype=torch.bool))
    for token in outputs:
        state.record(row, torch.tensor([token]))
    logits = state.apply(logits, row, torch.tensor([params.presence_penalty]),
                         torch.tensor([params.frequency_penalty]), torch.tensor([params.repetition_penalty]))
    keys = row_keys(torch.tensor([params.seed]), torch.tensor([len(outputs)]))
    words = torch.empty(1, (vocab + 1) // 2, dtype=torch.int64)
    neg_gumbel = neg_gumbel_from_words_(noise_words(keys, vocab, words, torch.empty_like(words)))[0]
    score = logits[0] - params.temperature * neg_gumbel  # [V]
    k = params.top_k if 0 < params.top_k < vocab else vocab
    kept = logits[0].topk(k).values  # [k] descending: top-k, then top-p over them
    probs = (kept / params.temperature).softmax(-1)
    mass_before = torch.cumsum(probs, 0) - probs
    kept = kept[(mass_before < params.top_p) | (params.top_p >= 1.0)]
    threshold = float(kept[-1])
    outside = [max(0.0, threshold - float(logits[0, t])) for t in pair]
    return abs(float(score[pair[0]] - score[pair[1]])) + sum(outside)


# transformers' forward on one intra-op thread: on a shared 2-core machine two spinning threads are several
# times slower than one (and a pool of the test's own would slow an in-process engine's device thread).
one_thread = one_kernel_thread


def logits_at(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of ``token_ids`` (one sequence): ``[len, V]`` float64;
    row ``p`` scores the token at ``p + 1``."""
    with torch.no_grad(), one_thread():
        return model(torch.tensor([token_ids])).logits[0].double()
