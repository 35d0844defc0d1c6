"""The simulated device: real plans and metadata, modelled time, pseudo-tokens.

The device thread copies the staging (as an H2D copy would), then models a GPU
queue: step N starts when it is launched or when step N-1 ends, whichever is
later, and ends ``SimConfig.step_seconds(...)`` after that. The thread sleeps
until the modelled end with the GIL released. Modelling the queue (instead of
timing the thread) keeps the Python thread's own wake-up jitter out of the
device timeline, as a real GPU's queue would.

The sim's own host work for a step (hashing the pseudo-tokens) holds the GIL,
which a real device's work does not, so it is placed where it takes time the
planner would spend blocked rather than time it works (at a step's start it ran
while an overlap planner applied the step before and planned the next). A
plain step's is done in the step's last moments, where a real device samples:
the thread sleeps until ``end`` less what that work took in the last step,
works, then sleeps to ``end``. A verify step's, the larger, is done by the
thread that waits for the step (``sim_verify``).

Pseudo-token of a sampled row = hash(request seed, output index, input token),
where the input token of a decode row is read from the device token buffer: a
wrong feedback path changes every later token. A request emits its
end-of-sequence token at its drawn output length (not before ``min_tokens``).

A step with grammar rows models the real device's order: the forward ends at
its modelled time, then sampling waits for the host's ``GrammarMask`` (the wait
is recorded, and idle), and each grammar row takes an allowed token picked by
its hash. Logprob rows get pseudo values (the chosen token at logprob 0).
"""

from __future__ import annotations

import time

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.engine.step_contract import StepMeta
from asyncbatch.executors.base import StepHandle, StepResult
from asyncbatch.executors.device_thread import DeviceThread, ThreadedExecutor
from asyncbatch.executors.sim_hash import mix64
from asyncbatch.executors.sim_verify import PendingVerify, verify_inputs
from asyncbatch.profiling.marks import mark
from asyncbatch.sampling.logprobs import TokenLogprobs

_PREFIX_WORDS = 16  # words of a row scanned first for a set bit (1,024 tokens: where JSON's punctuation lies)

def allowed_pick(bitmask: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Per grammar row ``[G]``, an allowed token chosen by the row's hash ``h`` ``[G]`` (uint64, mixed); 0 for
    a row with nothing allowed. ``bitmask`` ``[G, W]`` int32, bit set = allowed.

    Runs on the host between the mask's ready mark and the step's result (on a real device it is part of
    the sampling kernel), so it must cost next to nothing: one hash-chosen 64-token word per row, taken if
    any of its tokens is allowed (large allowed sets: string contents); else the row's first non-zero word,
    looked for in a short prefix first (small allowed sets: JSON punctuation), then in the whole row. A
    hash-chosen set bit of that word is the token. ~70 us for 128 JSON rows at vocab 49k, where hashing
    four candidate tokens per row and gathering whole rows cost ~300 us (profiles/structured-output-sim-*).
    """
    if bitmask.shape[1] % 2 == 0 and bitmask.flags.c_contiguous:
        words, lanes = bitmask.view(np.uint64), 64  # [G, W/2]
    else:
        words, lanes = np.ascontiguousarray(bitmask).view(np.uint32), 32  # [G, W]
    g, n = words.shape
    rows = np.arange(g)
    column = ((h >> np.uint64(8)) % np.uint64(n)).astype(np.int64)  # [G]
    word = words[rows, column]
    missed = (word == 0).nonzero()[0]
    if len(missed):
        head = words[missed, :_PREFIX_WORDS] != 0  # [F, P]
        found = head.any(axis=1)
        first = head.argmax(axis=1)
        if not found.all():
            far = (~found).nonzero()[0]
            first[far] = (words[missed[far]] != 0).argmax(axis=1)  # 0 where the row allows nothing
        column[missed] = first
        word = words[rows, column]
    word = word.astype(np.uint64)
    shift = (h >> np.uint64(40)) % np.uint64(lanes)
    if lanes == 64:  # rotate right by ``shift`` (shift 0: ``word | word``)
        rotated = (word >> shift) | (word << ((np.uint64(64) - shift) % np.uint64(64)))
    else:
        rotated = ((word | (word << np.uint64(32))) >> shift) & np.uint64(0xFFFFFFFF)
    lowest = rotated & (~rotated + np.uint64(1))  # its lowest set bit alone (a power of two: log2 is exact)
    bit = (np.log2(np.maximum(lowest, np.uint64(1)).astype(np.float64)).astype(np.int64)
           + shift.astype(np.int64)) % lanes
    return np.where(word != 0, column * lanes + bit, 0)


class SimExecutor(ThreadedExecutor):
    name = "sim"
    simulated = True

    def __init__(self, sim: SimConfig, vocab_size: int, eos_token_id: int | None, max_num_seqs: int,
                 first_token_id: int = 256, speculative: bool = False) -> None:
        self.sim = sim
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.first_token_id = min(first_token_id, vocab_size - 1)
        self.token_buffer = np.zeros(max_num_seqs, dtype=np.int64)  # the "device" token buffer
        self._device_free_at = 0.0
        # Speculative engines: what the device holds per token row (``speculative.device_state``, modelled): the
        # next input's position and the outputs so far.
        self.speculative = speculative
        self.length = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_outputs = np.zeros(max_num_seqs, dtype=np.int64)
        self.forward_hook = None
        self._host_s = 0.0  # the last step's host work (seconds): the next one starts it this long before its end
        self._host_start = 0.0
        self._verify = PendingVerify(self)  # launched verify steps, computed by whoever waits first
        self._thread = DeviceThread("asyncbatch-sim-device", self._run)

    def launch(self, meta: StepMeta) -> StepHandle:
        if self.speculative and meta.spec_depth:
            self._verify.add(verify_inputs(meta))  # before the staging buffer can be written again
        return super().launch(meta)

    def wait(self, handle: StepHandle) -> StepResult:
        if self.speculative:
            self._verify.ensure(handle.step_id)  # a verify step's tokens, in time the caller would block anyway
        return handle.result()

    def output_length(self, seeds: np.ndarray) -> np.ndarray:
        """Drawn output length (tokens up to and including EOS) of requests with these seeds."""
        lo, hi = self.sim.output_len_min, self.sim.output_len_max
        h = mix64(seeds.astype(np.uint64) ^ np.uint64(self.sim.seed * 7919 + 17))
        u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        if self.sim.output_len_distribution == "fixed":
            return np.full(seeds.shape, hi, dtype=np.int64)
        if self.sim.output_len_distribution == "uniform":
            return lo + np.minimum((u * (hi - lo + 1)).astype(np.int64), hi - lo)
        mean_extra = max((hi - lo) / 4.0, 1e-9)  # geometric, capped at hi
        extra = np.floor(np.log1p(-u) / np.log1p(-1.0 / (mean_extra + 1.0))).astype(np.int64)
        return np.minimum(lo + extra, hi)

    def _run(self, meta: StepMeta, handle: StepHandle) -> StepResult:
        s, t, nd, r = meta.staging, meta.num_tokens, meta.num_decode, meta.num_sampled
        t0 = time.perf_counter()
        with mark("h2d", meta.step_id):
            input_ids = s.input_ids[:t].copy()
            decode_rows = s.decode_token_rows[:nd].copy()
            logits_idx = s.logits_indices[:r].copy()
            sample_rows = s.sample_token_rows[:r].copy()
            seeds = s.sample_seed[:r].copy()
            steps = s.sample_step[:r].copy()
            s.slot_mapping[:t].sum()  # touch the metadata a real copy would move
        s.fence.signal()
        h2d_ms = (time.perf_counter() - t0) * 1e3

        start = max(handle.launch_time, self._device_free_at)
        end = start + self.sim.step_seconds(t, meta.context_tokens)
        if self.forward_hook is not None:
            self.forward_hook(meta)
        if self.speculative and meta.spec_depth:  # its tokens: computed by whoever waits for it (``sim_verify``)
            self._sleep_until(end, meta.step_id, " sim")
            self._device_free_at = end
            v = self._verify.take(meta.step_id)
            return StepResult(meta.step_id, v.tokens, np.ones(r, dtype=bool), device_start=start, device_end=end,
                              h2d_ms=h2d_ms, forward_ms=(end - start) * 1e3, num_emitted=v.emitted,
                              spec_counts=v.spec_counts)
        self._sleep_until(end - self._host_s, meta.step_id, " sim")  # the host work below ends near ``end``
        self._host_start = time.perf_counter()
        if self.speculative:  # decode rows' output counts live on the device (the planner's are upper bounds)
            self._verify.ensure(meta.step_id)  # earlier verify steps' tokens are in the device state
            steps[:nd] = self.num_outputs[decode_rows]
        input_ids[:nd] = self.token_buffer[decode_rows]
        fed = input_ids[logits_idx]
        h = self._hash(seeds, steps, fed)
        extras = meta.extras
        banned_eos = self._eos_banned(extras, r)
        tokens = self._pseudo_tokens(h, steps, seeds, banned_eos)
        self._end_host_work(end, meta.step_id)
        forward_ms, wait_ms, wait_start = (end - start) * 1e3, 0.0, 0.0
        if extras is not None and extras.grammar is not None:
            # The forward is done at ``end``; sampling waits for the host's mask like a real device would.
            wait_start = end
            grammar = extras.grammar
            with mark("grammar_mask_wait", meta.step_id):
                grammar.wait_ready()
            end = max(end, grammar.ready_time)
            wait_ms = (end - wait_start) * 1e3
            tokens[grammar.index] = allowed_pick(grammar.bitmask, h[grammar.index])
        self._device_free_at = end
        self.token_buffer[sample_rows] = tokens
        if self.speculative:  # one token a row: advance the modelled device state
            self.length[decode_rows] += 1
            self.num_outputs[decode_rows] += 1
            if r > nd:
                self.length[sample_rows[nd:]] = s.positions[logits_idx[nd:]] + 1
                self.num_outputs[sample_rows[nd:]] = steps[nd:] + 1
        result = StepResult(meta.step_id, tokens, np.ones(r, dtype=bool), device_start=start, device_end=end,
                            h2d_ms=h2d_ms, forward_ms=forward_ms, mask_wait_ms=wait_ms, mask_wait_start=wait_start)
        if extras is not None:
            result.logprobs, result.prompt_logprobs = self._pseudo_logprobs(extras, tokens)
        return result

    @staticmethod
    def _hash(seeds: np.ndarray, steps: np.ndarray, fed: np.ndarray) -> np.ndarray:
        """The pseudo-token hash of output ``steps`` of requests ``seeds`` fed token ``fed`` (``[N]`` each)."""
        return mix64(seeds.astype(np.uint64) * np.uint64(1_000_003) ^ mix64(steps.astype(np.uint64))
                     ^ (fed.astype(np.uint64) << np.uint64(20)))

    def _end_host_work(self, end: float, step_id: int) -> None:
        """The step's host work is done: remember how long it took (the next step starts it that much before its
        end), then sleep until the step's modelled end."""
        self._host_s = time.perf_counter() - self._host_start
        self._sleep_until(end, step_id, " sim")

    @staticmethod
    def _sleep_until(t: float, step_id: int, label: str) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            with mark("forward", step_id, label):
                time.sleep(delay)

    def _pseudo_tokens(self, h: np.ndarray, steps: np.ndarray, seeds: np.ndarray, banned_eos: np.ndarray | None
                       ) -> np.ndarray:
        """Hash tokens in ``[first_token_id, V)``, never EOS except at the drawn length (unless banned)."""
        ends = None if self.eos_token_id is None else steps + 1 >= self.output_length(seeds)
        return self.tokens_of(h, ends, banned_eos)

    def tokens_of(self, h: np.ndarray, ends: np.ndarray | None, banned_eos: np.ndarray | None) -> np.ndarray:
        """``_pseudo_tokens`` with the rows that reached their drawn length (``ends``: EOS there) known."""
        span = self.vocab_size - self.first_token_id
        tokens = self.first_token_id + (h % np.uint64(span)).astype(np.int64)
        eos = self.eos_token_id
        if eos is None:
            return tokens
        if eos >= self.first_token_id:  # a hash may land on EOS: moved off it (below first_token_id it cannot)
            tokens = np.where(tokens == eos, tokens + 1 if eos + 1 < self.vocab_size else self.first_token_id,
                              tokens)
        if ends is not None:
            if banned_eos is not None:
                ends = ends & ~banned_eos
            tokens = np.where(ends, eos, tokens)
        return tokens

    def _eos_banned(self, extras, r: int) -> np.ndarray | None:
        """``[R]`` rows whose EOS a -inf bias bans (``min_tokens``); the sim honours no other bias."""
        if extras is None or extras.bias is None or self.eos_token_id is None:
            return None
        bias = extras.bias
        hit = (bias.token_ids == self.eos_token_id) & np.isneginf(bias.values)
        banned = np.zeros(r, dtype=bool)
        banned[bias.index[hit]] = True
        return banned

    def _pseudo_logprobs(self, extras, tokens: np.ndarray):
        """Simulated logprobs: the sampled (or prompt) token has probability 1, the other top ids -inf."""
        def columns(ids: np.ndarray, k: int) -> TokenLogprobs:
            top = (ids[:, None] + np.arange(k)) % self.vocab_size
            top_lp = np.where(np.arange(k) == 0, 0.0, -np.inf).astype(np.float32)[None, :].repeat(len(ids), 0)
            return TokenLogprobs(np.zeros(len(ids), dtype=np.float32), np.ones(len(ids), dtype=np.int64), top, top_lp)

        chosen = None if extras.logprobs is None else columns(tokens[extras.logprobs.index], extras.logprobs.max_k)
        prompt = None if extras.prompt_logprobs is None else columns(extras.prompt_logprobs.target_ids,
                                                                      extras.prompt_logprobs.max_k)
        return chosen, prompt

    def describe(self) -> dict:
        return {"backend": "sim", "simulated": True, "sim": {
            f: getattr(self.sim, f) for f in self.sim.__slots__}}
