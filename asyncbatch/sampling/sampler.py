"""On-device token sampling: greedy, temperature, top-k, top-p and min-p.

Contract: row ``r``'s token is a function of ``logits[r]`` and row ``r`` of the
``SamplingTensors`` only (its parameters, its request's ``seed`` and ``step``, the
index of the output token being sampled). It never depends on the other rows or on
``r``'s position in the batch, so overlap and synchronous mode, graph replays and
recompute after preemption sample the same tokens. Randomness is a counter-based
hash of ``(seed, step, vocabulary index)``, not a generator: no state, no host
synchronisation, capturable into a CUDA graph. The noise stream's bits are part of
the reproducibility contract (``tests/test_sampler.py`` pins them).

A random row samples ``argmax(logits + T * gumbel_noise)`` over the tokens whose
logit reaches the row's threshold from top-k, then top-p, then min-p.

Specification: docs/sampling.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

# vLLM's _SAMPLING_EPS: temperatures below this are treated as greedy, which also
# keeps logits / T finite in the top-p softmax.
GREEDY_TEMPERATURE_EPS = 1e-5

# On CPU the random path runs in row blocks whose int64 scratch is about this big, so its
# elementwise passes reuse two mid-sized buffers instead of page-faulting fresh [R, V] ones
# (half the time at R=256, V=49152); much smaller blocks multiply the intra-op fork/join points.
# Accelerators run all rows at once. Results do not depend on the block size.
CPU_BLOCK_BYTES = 4 << 20


def _as_int64(c: int) -> int:
    """The two's-complement int64 value with the bits of the uint64 ``c``."""
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX_MUL_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_MUL_2 = _as_int64(0x94D049BB133111EB)
_MIX_ROUNDS = ((30, _MIX_MUL_1), (27, _MIX_MUL_2), (31, None))
_FLOAT_ONE_BITS = 0x3F800000  # float32 1.0: exponent 0, mantissa from the hash
_MANTISSA_MASK = 0x007FFFFF


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the logits' device; all tensors are ``[R]``."""

    temperature: torch.Tensor  # [R] float32, 0.0 = greedy
    top_k: torch.Tensor  # [R] int64, 0 = disabled (caller maps -1 to 0)
    top_p: torch.Tensor  # [R] float32 in (0, 1]
    min_p: torch.Tensor  # [R] float32 in [0, 1]
    seed: torch.Tensor  # [R] int64, per-request seed
    step: torch.Tensor  # [R] int64, index of the output token being sampled (0 for the first)


class SampleResult(NamedTuple):
    token_ids: torch.Tensor  # [R] int64
    # [R] bool. False where the row's logits had a NaN or +inf, or were all -inf; the
    # token is then 0 and the caller must discard it. A -inf logit alone is a valid
    # "never sample this token" mask and keeps the row finite.
    finite: torch.Tensor


def _mix_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer in place on int64 ``x``; ``scratch`` is same-shaped space.

    torch's ``>>`` on int64 is arithmetic, so the mask makes it the logical shift the
    algorithm needs; int64 multiplication wraps modulo 2**64, as it should.
    """
    for shift, mul in _MIX_ROUNDS:
        torch.bitwise_right_shift(x, shift, out=scratch)
        scratch.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(scratch)
        if mul is not None:
            x.mul_(mul)
    return x


def row_keys(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64 key of each row's noise: ``mix(mix(seed + G) + step * G)``."""
    x = seed.to(torch.int64) + _GOLDEN
    scratch = torch.empty_like(x)
    _mix_(x, scratch)
    x.add_(step.to(torch.int64) * _GOLDEN)
    return _mix_(x, scratch)


def noise_words(keys: torch.Tensor, vocab_size: int, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` ``[R, ceil(V/2)]`` int64 with ``word(j)`` per row; return it viewed
    as ``[R, V]`` int32, entry ``v`` being ``bits(v)`` (little-endian halves)."""
    num_words = out.shape[1]
    counters = (torch.arange(1, num_words + 1, device=keys.device, dtype=torch.int64) * _GOLDEN)  # [W]
    torch.add(keys[:, None], counters, out=out)
    _mix_(out, scratch)
    return out.view(torch.int32)[:, :vocab_size]


def neg_gumbel_from_words_(bits: torch.Tensor) -> torch.Tensor:
    """Turn int32 ``bits`` in place into ``-g = log(-log(u))``, float32, g ~ Gumbel(0, 1).

    Writing 22 hash bits plus a forced 1 into the mantissa of 1.0 gives a float in
    (1, 2) with an odd mantissa, so ``u = f - 1`` is exact and strictly inside (0, 1):
    neither log can see 0, and g stays within about [-2.8, 15.9]. The sign is left to
    the caller, which folds it into its next operation instead of a pass of its own.
    """
    bits.bitwise_and_(_MANTISSA_MASK).bitwise_or_(_FLOAT_ONE_BITS | 1)
    u = bits.view(torch.float32).sub_(1.0)
    return u.log_().neg_().log_()


def _keep_threshold(
    logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, row_max: torch.Tensor,
) -> torch.Tensor:
    """``[R]`` smallest logit each row keeps after top-k, then top-p, then min-p."""
    vocab_size = logits.shape[1]
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [R, V]
    k = _effective_top_k(top_k, vocab_size)
    in_top_k = torch.arange(vocab_size, device=logits.device) < k[:, None]  # [R, V]
    probs = (sorted_logits / temp[:, None]).masked_fill_(~in_top_k, -math.inf).softmax(dim=-1)
    top_k_top_p, _ = _kept_prefix(sorted_logits, probs, in_top_k, top_p)
    return torch.maximum(top_k_top_p, _min_p_threshold(temp, min_p, row_max))


def _effective_top_k(top_k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R]`` top-k with "off" (<= 0) and oversized values as the whole vocabulary."""
    return torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)


def _kept_prefix(sorted_values: torch.Tensor, probs: torch.Tensor, in_top_k: torch.Tensor,
                 top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over values sorted descending ``[R, C]`` and their probabilities: the smallest value top-k then top-p
    keep, and how many are kept (``[R]`` each)."""
    # Exclusive prefix sum built from the inclusive one so it is exactly monotone and
    # the kept positions form a prefix that a count describes.
    mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [R, C]
    # top_p == 1 keeps everything even if rounding lets the prefix mass reach 1 early.
    in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    count = (in_top_k & in_top_p).sum(dim=-1).clamp_(min=1)  # [R]; NaN rows may count 0
    return sorted_values.gather(1, (count - 1)[:, None]).squeeze(1), count


# On CPU a full sort of a 49k vocabulary costs ~2 ms a row, and the kept set of top-k/top-p is almost
# always within the largest few hundred logits: ``topk`` of this many candidates decides it, and only rows
# whose kept set might reach past them pay for the sort.
CPU_FILTER_CANDIDATES = 1024


def _keep_threshold_cpu(
    logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, row_max: torch.Tensor,
) -> torch.Tensor:
    """Same result as ``_keep_threshold`` from the top ``CPU_FILTER_CANDIDATES`` logits.

    Normalises over the top-k set when it lies within the candidates, else over
    the whole row (a logsumexp pass instead of a sort). Synchronises with the host
    to pick fallback rows, which is why only the CPU uses it.
    """
    _, vocab_size = logits.shape
    cand = min(CPU_FILTER_CANDIDATES, vocab_size)
    if cand == vocab_size:
        return _keep_threshold(logits, temp, top_k, top_p, min_p, row_max)
    values = logits.topk(cand, dim=-1).values  # [n, cand], descending
    k = _effective_top_k(top_k, vocab_size)
    in_top_k = torch.arange(cand, device=logits.device) < k[:, None]  # [n, cand]
    scaled = values / temp[:, None]
    log_norm = torch.logsumexp(scaled.masked_fill(~in_top_k, -math.inf), dim=-1)  # [n]
    wide = k > cand  # the top-k set reaches past the candidates: normalise over the whole row instead
    if bool(wide.any()):
        rows = wide.nonzero().squeeze(1)
        log_norm[rows] = torch.logsumexp(logits[rows] / temp[rows, None], dim=-1)
    probs = (scaled - log_norm[:, None]).exp_().masked_fill_(~in_top_k, 0.0)
    threshold, count = _kept_prefix(values, probs, in_top_k, top_p)
    unrestricted = (k >= vocab_size) & (top_p >= 1.0)
    threshold = torch.where(unrestricted, torch.full_like(threshold, -math.inf), threshold)
    beyond = (count == cand) & ~unrestricted  # the kept set may extend past the candidates
    if bool(beyond.any()):
        rows = beyond.nonzero().squeeze(1)
        threshold[rows] = _keep_threshold(logits[rows], temp[rows], top_k[rows], top_p[rows], min_p[rows],
                                          row_max[rows])
    return torch.maximum(threshold, _min_p_threshold(temp, min_p, row_max))


def _min_p_threshold(temp: torch.Tensor, min_p: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    # min_p == 0 gives log 0 = -inf: nothing dropped.
    return row_max + temp * torch.log(min_p)


def _sample_block(
    logits: torch.Tensor, keys: torch.Tensor, temp: torch.Tensor, st: SamplingTensors, rows: slice,
    row_max: torch.Tensor, filtered: bool, words: torch.Tensor, scratch: torch.Tensor,
) -> torch.Tensor:
    """Gumbel-max token ids ``[n]`` for ``logits[rows]``, using scratch ``[>=n, W]``."""
    block = logits[rows]  # [n, V]
    n, vocab_size = block.shape
    bits = noise_words(keys[rows], vocab_size, words[:n], scratch[:n])  # [n, V] int32
    score = neg_gumbel_from_words_(bits)  # [n, V] float32, aliases words
    # argmax(logits / T + g) == argmax(logits + T * g) for T > 0, and this form
    # avoids dividing the whole block.
    torch.addcmul(block, score, temp[rows, None], value=-1.0, out=score)
    if filtered:
        keep = _keep_threshold_cpu if block.device.type == "cpu" else _keep_threshold
        threshold = keep(block, temp[rows], st.top_k[rows], st.top_p[rows], st.min_p[rows], row_max[rows])
        score.masked_fill_(block < threshold[:, None], -math.inf)
    return score.max(dim=-1).indices


def _block_rows(num_rows: int, vocab_size: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(num_rows, 1)
    return max(1, min(num_rows, CPU_BLOCK_BYTES // (4 * max(vocab_size, 1))))


def sample(
    logits: torch.Tensor, st: SamplingTensors, *, all_greedy: bool = False, any_top_k_top_p_min_p: bool = True,
) -> SampleResult:
    """Sample one token per row of ``logits`` ``[R, V]`` float32 (not modified).

    Greedy rows (temperature < ``GREEDY_TEMPERATURE_EPS``) take the argmax, lowest index
    on ties. ``all_greedy`` (host-known: every row is greedy) skips all random work.
    ``any_top_k_top_p_min_p`` False promises that no row restricts its distribution
    and skips the filters, including the sort. Used truthfully, neither flag changes
    any token.

    Invariants: row ``r``'s token is a function of ``logits[r]`` and row ``r`` of ``st``
    only; no host synchronisation; for fixed shapes and flags the same kernels run
    every call, so the call can be captured into a CUDA graph.
    """
    row_max, greedy_ids = logits.max(dim=-1)  # [R], [R]; NaN propagates into row_max
    finite = torch.isfinite(row_max)
    if all_greedy:
        return SampleResult(torch.where(finite, greedy_ids, 0), finite)

    is_greedy = st.temperature < GREEDY_TEMPERATURE_EPS  # [R]
    temp = torch.where(is_greedy, 1.0, st.temperature).to(logits.dtype)  # [R]; 1.0 keeps greedy rows harmless
    keys = row_keys(st.seed, st.step)  # [R]
    num_rows, vocab_size = logits.shape
    block_rows = _block_rows(num_rows, vocab_size, logits.device)
    words = torch.empty(block_rows, (vocab_size + 1) // 2, dtype=torch.int64, device=logits.device)
    scratch = torch.empty_like(words)
    random_ids = torch.empty_like(greedy_ids)  # [R]
    for start in range(0, num_rows, block_rows):
        rows = slice(start, min(start + block_rows, num_rows))
        random_ids[rows] = _sample_block(
            logits, keys, temp, st, rows, row_max, any_top_k_top_p_min_p, words, scratch
        )
    token_ids = torch.where(is_greedy, greedy_ids, random_ids)
    return SampleResult(torch.where(finite, token_ids, 0), finite)
