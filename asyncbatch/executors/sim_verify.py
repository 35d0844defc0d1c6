"""The simulated device's verify steps: their tokens computed by the thread that waits for them.

    planner   launch N (inputs copied)  [plan N+1, launch N+1]  wait N: compute N ─► block until N's end
    device    [............ step N: sleep until its modelled end ............] ensure N (done) ─► result N

A real device computes a verify step's tokens itself; the sim's hashing of them
(about 0.3 ms at 256 rows on a 2-core VM, against 0.1 ms for a plain step) is
host work that holds the GIL. On the device thread it ran while an overlap
planner applied the step before and planned the next, and each slowed the
other; computed by the planner when it waits for the step, it takes time the
planner would spend blocked, as a real device's work would (and in
synchronous mode it still overlaps the step).

Steps are computed strictly in launch order, since each reads the device state
every earlier step left (``SimExecutor.token_buffer``, ``length``,
``num_outputs``), by whichever thread asks first (``ensure``): the waiting
planner, the device thread at the step's end, or the device thread before a
plain step, which reads the same state. The inputs are copied from the staging
buffer at launch, on the planner thread, before the buffer can be reused.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from asyncbatch.engine.step_contract import StepMeta
from asyncbatch.executors.sim_hash import mix64

if TYPE_CHECKING:
    from asyncbatch.executors.sim_executor import SimExecutor


@dataclass(slots=True)
class VerifyStep:
    """One verify step's inputs (copied at launch) and, once computed, its outcome."""

    step_id: int
    num_decode: int
    depth: int
    rows: np.ndarray  # [R] token rows, decode rows first
    seeds: np.ndarray  # [R]
    steps: np.ndarray  # [R] output index (exact for prefill rows; decode rows' come from the device state)
    prefill_fed: np.ndarray  # [R - D] each prefill row's last input token
    prefill_length: np.ndarray  # [R - D] its length once the chunk is computed
    context_lens: np.ndarray  # [D] the KV each decode row reserved (its drafts stop there)
    tokens: np.ndarray | None = None  # [R, 1 + depth]
    emitted: np.ndarray | None = None  # [R]
    spec_counts: tuple[int, int, int] = (0, 0, 0)  # rows that drafted, draft tokens, accepted drafts


def verify_inputs(meta: StepMeta) -> VerifyStep:
    """Copy what a verify step's tokens depend on out of its staging buffer (planner thread, at launch)."""
    s, nd, r = meta.staging, meta.num_decode, meta.num_sampled
    last = s.logits_indices[nd:r]
    return VerifyStep(meta.step_id, nd, meta.spec_depth, s.sample_token_rows[:r].copy(), s.sample_seed[:r].copy(),
                      s.sample_step[:r].copy(), s.input_ids[last], s.positions[last] + 1,
                      s.decode_context_lens[:nd].copy())


class PendingVerify:
    """Launched verify steps not computed yet, in launch order; computed ones until the device thread takes them."""

    def __init__(self, device: SimExecutor) -> None:
        self._device = device
        self._lock = threading.Lock()
        self._pending: deque[VerifyStep] = deque()
        self._done: dict[int, VerifyStep] = {}

    def add(self, step: VerifyStep) -> None:
        with self._lock:
            self._pending.append(step)

    def ensure(self, step_id: int) -> None:
        """Compute every pending step up to ``step_id``, in order."""
        with self._lock:
            while self._pending and self._pending[0].step_id <= step_id:
                step = self._pending.popleft()
                compute_verify(self._device, step)
                self._done[step.step_id] = step

    def take(self, step_id: int) -> VerifyStep:
        """The computed step ``step_id`` (device thread, at the step's end)."""
        self.ensure(step_id)
        with self._lock:
            return self._done.pop(step_id)


def compute_verify(device: SimExecutor, v: VerifyStep) -> None:
    """A verify step's tokens and acceptances from the device state, which it advances.

    Each decode row's tokens are the plain chain (output ``n`` = hash(seed, n, output ``n - 1``)) from its
    device state, ``1 + depth`` of them; of its drafts, each is accepted with probability
    ``SimConfig.spec_acceptance`` (a hash of the seed and the output index), the run stopping at the first
    rejection and at the KV the planner reserved. So a speculative run emits exactly a plain run's tokens,
    more of them per step, and the planner's one-step-late reconciliation runs as on a real device."""
    nd, depth, rows, seeds = v.num_decode, v.depth, v.rows, v.seeds
    r, width = len(rows), v.depth + 1
    steps = v.steps.copy()
    tokens = np.zeros((r, width), dtype=np.int64)
    fed = device.token_buffer[rows]  # [R] (a copy: fancy indexing)
    if r > nd:  # prefill rows' last token: its pseudo-token's input
        fed[nd:] = v.prefill_fed
        device.length[rows[nd:]] = v.prefill_length
        device.num_outputs[rows[nd:]] = steps[nd:]
    steps[:nd] = device.num_outputs[rows[:nd]]
    usable = np.minimum(depth, np.maximum(v.context_lens - device.length[rows[:nd]] - 1, 0))  # [D]
    # What does not depend on the chain is hashed for every position at once; only the fed token is hashed
    # position by position.
    index = steps[:, None] + np.arange(width)  # [R, W] output index of each position (prefill rows: 0 only)
    index_u = index.astype(np.uint64)
    base = seeds.astype(np.uint64)[:, None] * np.uint64(1_000_003) ^ mix64(index_u)  # [R, W]
    ends = None  # [R, W] the request's drawn length is reached: EOS (None: nowhere in this step)
    if device.eos_token_id is not None:
        ends = index + 1 >= device.output_length(seeds)[:, None]
        if not ends.any():
            ends = None
    fed_u = fed.astype(np.uint64)
    for j in range(width):
        n = r if j == 0 else nd
        h = mix64(base[:n, j] ^ (fed_u[:n] << np.uint64(20)))  # = SimExecutor._hash(seeds, steps + j, fed)
        fed_u[:n] = tokens[:n, j] = device.tokens_of(h, None if ends is None else ends[:n, j], None)
    # Draft j is accepted with probability spec_acceptance, while usable; the run stops at the first rejection.
    coin = mix64(seeds[:nd, None].astype(np.uint64) ^ mix64(index_u[:nd, :depth] + np.uint64(0x5EC))) >> np.uint64(11)
    accept = (coin.astype(np.float64) / float(1 << 53) < device.sim.spec_acceptance) & (np.arange(depth)
                                                                                          < usable[:, None])
    emitted = np.ones(r, dtype=np.int64)
    emitted[:nd] += np.logical_and.accumulate(accept, axis=1).sum(axis=1)
    device.token_buffer[rows] = tokens[np.arange(r), emitted - 1]
    device.length[rows[:nd]] += emitted[:nd]
    device.num_outputs[rows] += emitted
    v.tokens, v.emitted = tokens, emitted
    v.spec_counts = (int(np.count_nonzero(usable)), int(usable.sum()), int((emitted[:nd] - 1).sum()))

