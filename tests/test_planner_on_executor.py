"""The array planner feeding a real executor: a tiny Llama on the ``cpu`` backend, below the engine core.

The loop here is the core's in miniature (schedule, wait for the staging
fence, write, release drained, launch; apply ``lag`` steps later). Tokens must
not depend on the lag (synchronous vs overlap) nor on memory pressure
(preemption and recompute), with greedy and with seeded sampling and penalties.
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch
from tiny_models import EOS_ID, save_tiny_model

from asyncbatch.engine.block_manager import BlockManager, blocks_for_tokens
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.executors.torch_executor import TorchExecutor
from asyncbatch.model.loader import load_model
from asyncbatch.sampling_params import SamplingParams

MAX_LEN, BLOCK_SIZE, MAX_SEQS, BUDGET = 128, 4, 4, 24


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM",
                           max_position_embeddings=MAX_LEN)
    return load_model(path, torch.float32, "cpu", max_positions=MAX_LEN)


def generate(model, prompts: list[list[int]], params: list[SamplingParams], num_blocks: int,
             lag: int) -> tuple[dict[int, list[int]], int]:
    """Every request's output tokens, and the number of preemptions."""
    max_blocks = blocks_for_tokens(MAX_LEN, BLOCK_SIZE)
    executor = TorchExecutor(model, model.new_kv_caches(num_blocks, BLOCK_SIZE), MAX_SEQS, torch.device("cpu"))
    blocks = BlockManager(num_blocks, BLOCK_SIZE, MAX_SEQS, max_blocks)
    scheduler = Scheduler(blocks, BUDGET, eos_token_id=EOS_ID)
    writer = StepMetadataWriter(scheduler.rows, blocks)
    staging = StagingPair(BUDGET, MAX_SEQS, max_blocks, pinned=False)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        scheduler.add(Request(str(i), i, prompt, p, 1000 + i, 0.0))
    outputs: dict[int, list[int]] = defaultdict(list)
    in_flight: deque = deque()
    try:
        while scheduler.has_work() or in_flight:
            plan = scheduler.schedule()
            if plan is not None:
                buffer = staging.next_buffer()
                buffer.fence.wait()
                buffer.fence.arm()
                meta = writer.write(plan, buffer)
                scheduler.release_drained(plan)
                in_flight.append((plan, executor.launch(meta)))
            if in_flight and (len(in_flight) > lag or plan is None):
                done, handle = in_flight.popleft()
                result = executor.wait(handle)
                applied = scheduler.apply(done, result.token_ids, result.finite)
                assert not applied.errored
                for seq, token in zip(applied.seqs.tolist(), applied.token_ids.tolist()):
                    outputs[seq].append(token)
            scheduler.check_integrity()
    finally:
        executor.close()
    assert blocks.num_free_blocks == blocks.num_usable_blocks
    return dict(outputs), scheduler.num_preemptions


def workload(sampled: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[3 + (i * 13 + j) % 250 for j in range(3 + 5 * i)] for i in range(7)]
    if sampled:
        params = [SamplingParams(max_tokens=8 + i, temperature=0.9, top_k=20, presence_penalty=0.5, seed=7 + i,
                                 ignore_eos=True) for i in range(7)]
    else:
        params = [SamplingParams(max_tokens=8 + i, temperature=0.0, ignore_eos=True) for i in range(7)]
    return prompts, params


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_tokens_independent_of_lag_and_memory_pressure(tiny_model, sampled):
    prompts, params = workload(sampled)
    roomy, roomy_preemptions = generate(tiny_model, prompts, params, num_blocks=200, lag=0)
    assert roomy_preemptions == 0
    assert [len(roomy[i]) for i in range(7)] == [p.max_tokens for p in params]
    overlap, _ = generate(tiny_model, prompts, params, num_blocks=200, lag=1)
    assert overlap == roomy
    for lag in (0, 1):
        tight, preemptions = generate(tiny_model, prompts, params, num_blocks=16, lag=lag)
        assert preemptions > 0, "the tight cache should force preemptions"
        assert tight == roomy
