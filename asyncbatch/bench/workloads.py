"""Synthetic request sets shared by the demo and the benchmark scripts.

Prompts are random token ids; lengths follow the named distribution. Every
generator is seeded, so every system in a comparison gets the same requests,
and a smaller ``n`` of the same workload is a prefix of the larger one (prompt
lengths, output lengths and token ids come from separate seeded streams).

Workloads:

- ``uniform``: lengths uniform in inclusive ranges (the demo's workload).
- ``random``: vLLM's ``RandomDataset`` definition: lengths uniform in
  ``[int(len * (1 - r)), int(len * (1 + r))]`` for a range ratio ``r`` in [0, 1).
- ``sharegpt``: lognormal lengths with ShareGPT's published means (see
  ``SHAREGPT``), clipped like vLLM's ShareGPT sampler; no download.
- ``nanovllm``: nano-vllm's ``bench.py`` exactly: Python ``random.seed(0)``,
  256 requests, prompt and output lengths uniform in 100-1024, token ids in
  0-10000 (142,827 prompt and 133,966 output tokens in all), so results can be
  compared with the numbers its README publishes.
- ``shared_prefix``: every request is one system prompt of ``system_len``
  tokens followed by its own ``question_len``-token question (prefix caching's
  best case: all but the first requests can reuse the system prompt).
- ``multiturn``: conversations that resend their history: turn ``t`` is the
  system prompt, the ``t - 1`` earlier (question, reply) pairs and a new
  question. Replies are recorded tokens (a dataset's answers), not this run's
  outputs, so every turn can be submitted at once; requests are ordered turn
  by turn (every conversation's first turn, then every second turn, ...), so
  an earlier turn is usually computed before the turn that extends it.

For the last two, ``prefix_share`` gives the share of prompt tokens a cache of
whole blocks could reuse at best.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import numpy as np

WORKLOADS = ("uniform", "random", "sharegpt", "nanovllm", "shared_prefix", "multiturn")


@dataclass(slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class LogNormalLengths:
    """Parameters of the ``sharegpt`` workload.

    Means: the vLLM paper (Kwon et al., SOSP 2023, Fig. 11) reports ShareGPT
    prompts of 161.31 and outputs of 337.99 tokens on average. The paper gives
    histograms, not dispersions: the log-space sigmas below are our reading of
    those long right tails (median about 0.6x the mean for prompts, 0.7x for
    outputs); pass other values to ``sharegpt_requests`` to change them. Clipping
    follows vLLM's ShareGPT filter (each side >= 4 tokens, prompt <= 1024, prompt +
    output <= 2048), which shortens the tails a little, so the realised means
    are a few percent below the published ones.
    """

    input_mean: float = 161.31
    output_mean: float = 337.99
    input_sigma: float = 1.0
    output_sigma: float = 0.85
    min_len: int = 4
    max_input: int = 1024
    max_total: int = 2048


SHAREGPT = LogNormalLengths()


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int, first_token_id: int) -> list[int]:
    low = first_token_id if first_token_id < vocab_size else 0
    return rng.integers(low, vocab_size, size=n).tolist()


def uniform_requests(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                     seed: int = 0, first_token_id: int = 256) -> list[WorkItem]:
    """``n`` requests with prompt and output lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        plen = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        olen = int(rng.integers(output_range[0], output_range[1] + 1))
        ids = _token_ids(rng, plen, vocab_size, first_token_id)
        items.append(WorkItem(ids, olen))
    return items


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int = 0, first_token_id: int = 256) -> list[WorkItem]:
    """vLLM's random dataset: lengths uniform in ``[int(len*(1-r)), int(len*(1+r))]``, at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    rng_in, rng_out, rng_tok = np.random.default_rng(seed).spawn(3)

    def lengths(rng: np.random.Generator, length: int) -> np.ndarray:
        low = max(int(length * (1 - range_ratio)), 1)
        high = max(int(length * (1 + range_ratio)), low)
        return rng.integers(low, high + 1, size=n)

    input_lens, output_lens = lengths(rng_in, input_len), lengths(rng_out, output_len)
    return [WorkItem(_token_ids(rng_tok, int(p), vocab_size, first_token_id), int(o))
            for p, o in zip(input_lens, output_lens)]


def sharegpt_requests(n: int, vocab_size: int, seed: int = 0, params: LogNormalLengths = SHAREGPT,
                      first_token_id: int = 256) -> list[WorkItem]:
    """ShareGPT-like lengths: lognormal with the published means, clipped like vLLM's sampler."""
    rng_in, rng_out, rng_tok = np.random.default_rng(seed).spawn(3)

    def lognormal(rng: np.random.Generator, mean: float, sigma: float) -> np.ndarray:
        mu = math.log(mean) - sigma**2 / 2  # so that E[X] = mean before clipping
        return rng.lognormal(mu, sigma, size=n)

    raw_in = lognormal(rng_in, params.input_mean, params.input_sigma)
    raw_out = lognormal(rng_out, params.output_mean, params.output_sigma)
    items = []
    for p, o in zip(raw_in, raw_out):
        plen = int(np.clip(round(p), params.min_len, params.max_input))
        olen = int(np.clip(round(o), params.min_len, params.max_total - plen))
        items.append(WorkItem(_token_ids(rng_tok, plen, vocab_size, first_token_id), olen))
    return items


def nanovllm_requests(n: int = 256, vocab_size: int = 10001) -> list[WorkItem]:
    """nano-vllm's ``bench.py`` workload; ``n < 256`` takes its first ``n`` requests.

    Token ids are ``randint(0, 10000)`` as there; a vocabulary smaller than that
    (test models) folds them modulo ``vocab_size``, leaving the lengths intact.
    """
    if not 1 <= n <= 256:
        raise ValueError(f"the nanovllm workload has 256 requests; n must be in [1, 256], got {n}")
    rnd = random.Random(0)
    prompts = [[rnd.randint(0, 10000) for _ in range(rnd.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rnd.randint(100, 1024) for _ in range(256)]
    if vocab_size <= 10000:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return [WorkItem(p, m) for p, m in zip(prompts[:n], max_tokens[:n])]


def shared_prefix_requests(n: int, system_len: int, question_len: int, output_len: int, vocab_size: int,
                           seed: int = 0, first_token_id: int = 256) -> list[WorkItem]:
    """``n`` requests: one ``system_len``-token system prompt, then a ``question_len``-token question each."""
    if system_len < 0 or question_len < 0 or system_len + question_len < 1 or output_len < 1:
        raise ValueError(f"need system_len, question_len >= 0 with a non-empty prompt and output_len >= 1, got "
                         f"{system_len}, {question_len}, {output_len}")
    rng_system, rng_questions = np.random.default_rng(seed).spawn(2)
    system = _token_ids(rng_system, system_len, vocab_size, first_token_id)
    return [WorkItem(system + _token_ids(rng_questions, question_len, vocab_size, first_token_id), output_len)
            for _ in range(n)]


def multiturn_requests(n: int, turns: int, system_len: int, question_len: int, reply_len: int, output_len: int,
                       vocab_size: int, seed: int = 0, first_token_id: int = 256) -> list[WorkItem]:
    """``n`` requests from ``ceil(n / turns)`` conversations of up to ``turns`` turns, turn by turn.

    Turn ``t`` (from 1) of a conversation is ``system + (q_1 + r_1) + ... + (q_{t-1} + r_{t-1}) + q_t``: the
    system prompt (shared by every conversation), earlier questions of ``question_len`` tokens with their
    recorded ``reply_len``-token replies, and a new question.
    """
    if turns < 1 or question_len < 1 or system_len < 0 or reply_len < 0 or output_len < 1:
        raise ValueError(f"need turns, question_len, output_len >= 1 and system_len, reply_len >= 0, got "
                         f"{turns}, {question_len}, {output_len}, {system_len}, {reply_len}")
    conversations = -(-n // turns)
    rng_system, rng_turns = np.random.default_rng(seed).spawn(2)
    system = _token_ids(rng_system, system_len, vocab_size, first_token_id)
    histories = [list(system) for _ in range(conversations)]
    items = []
    for _ in range(turns):
        for history in histories:
            if len(items) == n:
                return items
            question = _token_ids(rng_turns, question_len, vocab_size, first_token_id)
            items.append(WorkItem(history + question, output_len))
            history += question + _token_ids(rng_turns, reply_len, vocab_size, first_token_id)
    return items


def prefix_share(items: list[WorkItem], block_size: int = 16) -> float:
    """Share of prompt tokens reusable from earlier requests' prompts, in whole blocks, keeping the last token
    of each prompt computed: what an unbounded prefix cache that sees the requests in order could reuse."""
    seen: set[tuple[int, ...]] = set()
    reusable = total = 0
    for it in items:
        ids = it.prompt_token_ids
        total += len(ids)
        hit = True
        for j in range(len(ids) // block_size):
            prefix = tuple(ids[:(j + 1) * block_size])
            if hit and prefix in seen and (j + 1) * block_size <= len(ids) - 1:
                reusable += block_size
            else:
                hit = False
            seen.add(prefix)
    return reusable / total if total else 0.0


def build_workload(name: str, n: int, vocab_size: int, seed: int = 0, input_len: int = 1024,
                   output_len: int = 128, range_ratio: float = 0.0, prompt_range: tuple[int, int] = (16, 128),
                   output_range: tuple[int, int] = (8, 128), system_len: int = 512, question_len: int = 32,
                   turns: int = 4) -> list[WorkItem]:
    """The named workload; arguments that do not apply to it are ignored (``multiturn`` replies are
    ``output_len`` tokens long, as if each turn's answer were resent)."""
    if name == "uniform":
        return uniform_requests(n, prompt_range, output_range, vocab_size, seed)
    if name == "random":
        return random_requests(n, input_len, output_len, range_ratio, vocab_size, seed)
    if name == "sharegpt":
        return sharegpt_requests(n, vocab_size, seed)
    if name == "nanovllm":
        return nanovllm_requests(n, vocab_size)
    if name == "shared_prefix":
        return shared_prefix_requests(n, system_len, question_len, output_len, vocab_size, seed)
    if name == "multiturn":
        return multiturn_requests(n, turns, system_len, question_len, output_len, output_len, vocab_size, seed)
    raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")


def describe(items: list[WorkItem]) -> dict:
    """Token counts of a request set, for reports."""
    p = np.array([len(it.prompt_token_ids) for it in items])
    o = np.array([it.max_tokens for it in items])
    return {"num_requests": len(items), "prompt_tokens": int(p.sum()), "output_tokens": int(o.sum()),
            "prompt_len_mean": float(p.mean()), "prompt_len_min": int(p.min()), "prompt_len_max": int(p.max()),
            "output_len_mean": float(o.mean()), "output_len_min": int(o.min()), "output_len_max": int(o.max())}


def sharegpt_params() -> dict:
    return asdict(SHAREGPT)


def parse_range(text: str) -> tuple[int, int]:
    """``"low,high"`` (inclusive token counts, as the ``--prompt-range`` options take them)."""
    low, high = (int(x) for x in text.split(","))
    if not 1 <= low <= high:
        raise ValueError(f"a range must be 'low,high' with 1 <= low <= high, got {text!r}")
    return low, high
