"""Planner cost per step at 16 to 512 running requests, and KV block allocation.

The planner step is what the planner thread does between two launches in the
decode phase: ``Scheduler.schedule``, ``StepMetadataWriter.write`` into a host
staging, ``release_drained``, and applying the step's sampled tokens (what
``EngineCore._apply`` does to the requests). No device is involved, so this is
the CPU cost overlap mode must hide behind each device step.
"""

from __future__ import annotations

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
        self.blocks = BlockManager(n * MAX_BLOCKS_PER_SEQ // 4, BLOCK_SIZE)
        self.scheduler = Scheduler(self.blocks, n, budget)
        self.writer = StepMetadataWriter(n, MAX_BLOCKS_PER_SEQ, BLOCK_SIZE)
        self.staging = StagingPair(budget, n, MAX_BLOCKS_PER_SEQ, pinned=False)
        params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
        self.requests = [Request(f"r{i}", i, [5] * (50 + i % 100), params, i, 0.0) for i in range(n)]
        for request in self.requests:
            self.scheduler.add(request)
        while any(r.in_prefill or r.token_row is None for r in self.requests):
            self.step()

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        assert plan is not None
        self.writer.write(plan, self.staging.next_buffer())
        self.scheduler.release_drained(plan)
        for row in plan.rows:  # the tokens come back: what EngineCore._apply does per sampled row
            if row.samples:
                row.request.num_pending -= 1
                row.request.output_token_ids.append(7)
        return plan


@pytest.mark.parametrize("num_running", [16, 64, 256, 512])
def test_planner_step(benchmark, num_running):
    rig = PlannerRig(num_running)
    benchmark.group = "planner step (decode)"
    benchmark.extra_info["num_running"] = num_running
    plan = benchmark.pedantic(rig.step, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    assert plan.num_decode == num_running and plan.num_tokens == num_running
    rig.scheduler.check_integrity()


@pytest.mark.parametrize("num_running", [16, 256])
def test_schedule_only(benchmark, num_running):
    """``Scheduler.schedule`` alone: the part that is pure Python per request."""
    rig = PlannerRig(num_running)
    benchmark.group = "schedule only (decode)"

    def schedule_and_apply() -> None:
        plan = rig.scheduler.schedule()
        rig.scheduler.release_drained(plan)
        for row in plan.rows:
            row.request.num_pending -= 1
            row.request.output_token_ids.append(7)

    benchmark.pedantic(schedule_and_apply, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    rig.scheduler.check_integrity()


@pytest.mark.parametrize("blocks_per_request", [1, 8])
def test_block_allocate_and_free(benchmark, blocks_per_request):
    """256 requests each take ``blocks_per_request`` blocks, then all are freed: one round."""
    manager = BlockManager(256 * blocks_per_request + 1, BLOCK_SIZE)
    params = SamplingParams(max_tokens=1)
    requests = [Request(f"r{i}", i, [5], params, i, 0.0) for i in range(256)]
    tokens = blocks_per_request * BLOCK_SIZE
    benchmark.group = "block allocation (256 requests)"

    def cycle() -> None:
        for request in requests:
            manager.allocate(request, tokens)
        for request in requests:
            manager.free(request)

    benchmark(cycle)
    assert manager.num_free_blocks == manager.num_usable_blocks
    manager.check_integrity(requests)
