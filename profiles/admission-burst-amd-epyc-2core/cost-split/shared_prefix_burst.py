"""An admission burst of 96 requests with 80-token prompts at an idle scheduler, launch-path CPU (``schedule`` +
``write``) per request, best of 7 rigs, warm (no ``gc.collect``) and cold (after one): prompts that share nothing
(``shared prefix False``), and prompts that share a 64-token prefix (4 blocks) the cache holds from a first wave,
then 16 tokens of their own (``True``: each admission a cache hit on 4 blocks).

    PYTHONPATH=<tree> python shared_prefix_burst.py
"""

import gc
import time

import numpy as np

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.sampling_params import SamplingParams

BURST = 96


def one(seed: int, cold: bool, shared: bool) -> tuple[float, int]:
    rng = np.random.default_rng(seed)
    blocks = BlockManager(BURST * 8 + 64, 16, BURST, 32, prefix_caching=True)
    sched = Scheduler(blocks, 8192, eos_token_id=2)
    writer = StepMetadataWriter(sched.rows, blocks)
    staging = StagingPair(8192, BURST, 32, pinned=False)
    prefix = rng.integers(256, 30000, 64).tolist()

    def add(i: int, head: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sched.add(Request(str(i), i, head + rng.integers(256, 30000, 16).tolist(), params, i, 0.0))

    # A first wave touches every row once; its first request caches the shared prefix.
    for i in range(BURST):
        add(10**6 + i, prefix if shared and i == 0 else rng.integers(256, 30000, 64).tolist(), 2)
    while sched.has_work():
        plan = sched.schedule()
        meta = writer.write(plan, staging.next_buffer())
        sched.release_drained(plan)
        sched.apply(plan, np.full(meta.num_sampled, 7, dtype=np.int64), np.ones(meta.num_sampled, dtype=bool))
    sched.settle_released()
    for i in range(BURST):
        add(i, prefix if shared else rng.integers(256, 30000, 64).tolist(), 400)
    if cold:
        gc.collect()
    gc.freeze()
    start = time.thread_time_ns()
    plan = sched.schedule()
    writer.write(plan, staging.next_buffer())
    cpu = time.thread_time_ns() - start
    gc.unfreeze()
    assert plan.num_admitted == BURST
    return cpu / 1e3 / BURST, sum(row.num_cached for row in plan.prefill)


def main() -> None:
    for shared in (False, True):
        for cold in (False, True):
            runs = [one(seed, cold, shared) for seed in range(7)]
            print(f"shared prefix {shared!s:5} cold {cold!s:5}: {min(r[0] for r in runs):5.2f} us a request, "
                  f"cached tokens {runs[0][1]}")


if __name__ == "__main__":
    main()
