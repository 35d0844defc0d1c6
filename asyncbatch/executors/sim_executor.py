"""The simulated device: real plans and metadata, modelled time, pseudo-tokens.

The device thread copies the staging (as an H2D copy would), then models a GPU
queue: step N starts when it is launched or when step N-1 ends, whichever is
later, and ends ``SimConfig.step_seconds(...)`` after that. The thread sleeps
until the modelled end with the GIL released. Modelling the queue (instead of
timing the thread) keeps the Python thread's own wake-up jitter out of the
device timeline, as a real GPU's queue would.

Pseudo-token of a sampled row = hash(request seed, output index, input token),
where the input token of a decode row is read from the device token buffer: a
wrong feedback path changes every later token. A request emits its
end-of-sequence token at its drawn output length.
"""

from __future__ import annotations

import time

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.engine.step_contract import StepMeta
from asyncbatch.executors.base import StepHandle, StepResult
from asyncbatch.executors.device_thread import DeviceThread, ThreadedExecutor
from asyncbatch.profiling.marks import mark

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x + _GOLDEN).astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


class SimExecutor(ThreadedExecutor):
    name = "sim"
    simulated = True

    def __init__(self, sim: SimConfig, vocab_size: int, eos_token_id: int | None, max_num_seqs: int,
                 first_token_id: int = 256) -> None:
        self.sim = sim
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.first_token_id = min(first_token_id, vocab_size - 1)
        self.token_buffer = np.zeros(max_num_seqs, dtype=np.int64)  # the "device" token buffer
        self._device_free_at = 0.0
        self.forward_hook = None
        self._thread = DeviceThread("asyncbatch-sim-device", self._run)

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
        self._device_free_at = end
        if self.forward_hook is not None:
            self.forward_hook(meta)
        input_ids[:nd] = self.token_buffer[decode_rows]
        fed = input_ids[logits_idx]
        span = self.vocab_size - self.first_token_id
        h = mix64(seeds.astype(np.uint64) * np.uint64(1_000_003) ^ mix64(steps.astype(np.uint64))
                  ^ (fed.astype(np.uint64) << np.uint64(20)))
        tokens = self.first_token_id + (h % np.uint64(span)).astype(np.int64)
        if self.eos_token_id is not None:
            tokens = np.where(tokens == self.eos_token_id, tokens + 1 if self.eos_token_id + 1 < self.vocab_size
                              else self.first_token_id, tokens)
            tokens = np.where(steps + 1 >= self.output_length(seeds), self.eos_token_id, tokens)
        self.token_buffer[sample_rows] = tokens
        delay = end - time.perf_counter()
        if delay > 0:
            with mark("forward", meta.step_id, " sim"):
                time.sleep(delay)
        return StepResult(meta.step_id, tokens, np.ones(r, dtype=bool), device_start=start, device_end=end,
                          h2d_ms=h2d_ms, forward_ms=(end - start) * 1e3)

    def describe(self) -> dict:
        return {"backend": "sim", "simulated": True, "sim": {
            f: getattr(self.sim, f) for f in self.sim.__slots__}}
