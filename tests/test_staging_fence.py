"""Invariant 3: a staging buffer is never rewritten while the copy out of it may still be in flight.

The simulated device is made slow to copy (it sleeps before reading the staging)
and every staging's contents are checked at copy time against what the planner
wrote for that step. With the fence the two always agree. The negative
control overwrites a staging right after it is written, as a racing writer
would, to show the check catches it. (With two staging buffers and at most two steps in
flight, the planner's wait for step N already orders the rewrite of N's staging
after N's copy; the fence keeps the invariant true whatever the depth.)
"""

from __future__ import annotations

import time

import numpy as np

from asyncbatch import SamplingParams, SimConfig

SLOW_COPY_S = 0.003


def run_with_checked_copies(make_llm, overwrite_step: int | None = None) -> int:
    llm = make_llm(device="sim", engine_process=False, sim=SimConfig(step_fixed_ms=0.0, per_token_us=0.0, per_context_token_ns=0.0,
                                                output_len_distribution="fixed", output_len_max=64))
    core = llm._core
    written: dict[int, np.ndarray] = {}
    real_write = core.writer.write

    def write(plan, staging):
        meta = real_write(plan, staging)
        written[meta.step_id] = np.concatenate([staging.positions[:meta.num_tokens],
                                                staging.sample_step[:meta.num_sampled]]).copy()
        if meta.step_id == overwrite_step:
            staging.positions[:meta.num_tokens] += 1  # what a writer racing the copy would do
        return meta

    core.writer.write = write
    executor = core.executor
    real_prepare = executor._prepare  # the sim's copy out of the staging happens here
    mismatches = []

    def slow_prepare(meta, handle):
        time.sleep(SLOW_COPY_S)  # the copy starts late, as a busy copy engine would
        seen = np.concatenate([meta.staging.positions[:meta.num_tokens], meta.staging.sample_step[:meta.num_sampled]])
        if not np.array_equal(seen, written[meta.step_id]):
            mismatches.append(meta.step_id)
        return real_prepare(meta, handle)

    executor._thread._prepare = slow_prepare
    llm.generate([[300 + i] * (4 + i) for i in range(16)], SamplingParams(max_tokens=40, temperature=0.0),
                 use_tqdm=False)
    return len(mismatches)


def test_fence_protects_slots(make_llm):
    assert run_with_checked_copies(make_llm) == 0


def test_check_detects_an_overwritten_slot(make_llm):
    assert run_with_checked_copies(make_llm, overwrite_step=5) == 1
