"""Planner cost per step at 16 to 2048 running requests, and KV block allocation.

The planner step is what the planner thread does between two launches in the
decode phase: ``Scheduler.schedule``, ``StepMetadataWriter.write`` into a host
staging buffer, ``release_drained``, and ``Scheduler.apply`` of the step's
sampled tokens. No device is involved, so this is the CPU cost overlap mode
must hide behind each device step. ``scripts/bench_planner.py`` measures the
same path against an older commit, side by side.
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler, StepPlan
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.sampling_params import SamplingParams

BLOCK_SIZE = 16
MAX_BLOCKS_PER_SEQ = 512  # 8192-token contexts
ROUNDS = 300


class PlannerRig:
    """A scheduler with ``n`` requests, all past their prefill, and the metadata writer behind it."""

    def __init__(self, n: int) -> None:
        budget = max(2048, n)
        self.blocks = BlockManager(n * MAX_BLOCKS_PER_SEQ // 4, BLOCK_SIZE, n, MAX_BLOCKS_PER_SEQ)
        self.scheduler = Scheduler(self.blocks, budget)
        self.writer = StepMetadataWriter(self.scheduler.rows, self.blocks)
        self.staging = StagingPair(budget, n, MAX_BLOCKS_PER_SEQ, pinned=False)
        self.tokens, self.finite = np.full(n, 7, dtype=np.int64), np.ones(n, dtype=bool)
        params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
        for i in range(n):
            self.scheduler.add(Request(f"r{i}", i, [5] * (50 + i % 100), params, i, 0.0))
        while self.step().num_decode < n:
            pass

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        assert plan is not None
        meta = self.writer.write(plan, self.staging.next_buffer())
        self.scheduler.release_drained(plan)
        r = meta.num_sampled
        self.scheduler.apply(plan, self.tokens[:r], self.finite[:r])
        return plan


@pytest.mark.parametrize("num_running", [16, 64, 256, 512, 1024, 2048])
def test_planner_step(benchmark, num_running):
    rig = PlannerRig(num_running)
    benchmark.group = "planner step (decode)"
    benchmark.extra_info["num_running"] = num_running
    plan = benchmark.pedantic(rig.step, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    assert plan.num_decode == num_running and plan.num_tokens == num_running
    rig.scheduler.check_integrity()


@pytest.mark.parametrize("num_running", [16, 256, 2048])
def test_schedule_only(benchmark, num_running):
    """``Scheduler.schedule`` and ``apply`` without the metadata writer."""
    rig = PlannerRig(num_running)
    benchmark.group = "schedule + apply (decode)"

    def schedule_and_apply() -> None:
        plan = rig.scheduler.schedule()
        rig.scheduler.release_drained(plan)
        rig.scheduler.apply(plan, rig.tokens[:plan.num_sampled], rig.finite[:plan.num_sampled])

    benchmark.pedantic(schedule_and_apply, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    rig.scheduler.check_integrity()


@pytest.mark.parametrize("blocks_per_request", [1, 8])
def test_block_allocate_and_free(benchmark, blocks_per_request):
    """256 token rows each take ``blocks_per_request`` blocks, then all are freed: one round."""
    manager = BlockManager(256 * blocks_per_request + 1, BLOCK_SIZE, 256, blocks_per_request)
    tokens = blocks_per_request * BLOCK_SIZE
    benchmark.group = "block allocation (256 rows)"

    def cycle() -> None:
        for row in range(256):
            manager.allocate(row, tokens)
        for row in range(256):
            manager.free(row)

    benchmark(cycle)
    assert manager.num_free_blocks == manager.num_usable_blocks
    manager.check_integrity(np.zeros(0, dtype=np.int64))
