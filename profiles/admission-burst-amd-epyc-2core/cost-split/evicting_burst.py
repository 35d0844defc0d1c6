"""An admission burst into a KV cache full of cached blocks: what a server that has run a while sees with prefix
caching on (freed blocks stay cached until evicted, so the free stack of never-used blocks runs out early). A first
wave of ``burst`` requests fills the cache (every block cached and evictable once they finish); then ``burst`` new
ones, 32-token prompts that hit nothing, arrive at the idle scheduler: every admission evicts. Launch-path CPU of
that admission step (``schedule`` + ``write``) per request, best of 7, warm (no ``gc.collect``), with the number of
blocks evicted and of array batches (``Admitter._apply`` calls) it took.

    PYTHONPATH=<tree> python evicting_burst.py
"""

import gc
import time

import numpy as np

from asyncbatch.engine import admission
from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.sampling_params import SamplingParams

PROMPT = 32
calls = [0]
_apply = admission.Admitter._apply


def counted(self, *args, **kwargs):
    calls[0] += 1
    return _apply(self, *args, **kwargs)


admission.Admitter._apply = counted


def one(seed: int, burst: int) -> tuple[float, int, int]:
    rng = np.random.default_rng(seed)
    blocks = BlockManager(burst * 2 + 1, 16, burst, 32, prefix_caching=True)  # room for one wave's blocks
    sched = Scheduler(blocks, 8192, eos_token_id=2)
    writer = StepMetadataWriter(sched.rows, blocks)
    staging = StagingPair(8192, burst, 32, pinned=False)

    def add(i: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sched.add(Request(str(i), i, rng.integers(256, 30000, PROMPT).tolist(), params, i, 0.0))

    for i in range(burst):  # the first wave: 2 blocks each, all cached once it ends
        add(10**6 + i, 1)
    while sched.has_work():
        plan = sched.schedule()
        meta = writer.write(plan, staging.next_buffer())
        sched.release_drained(plan)
        sched.apply(plan, np.full(meta.num_sampled, 7, dtype=np.int64), np.ones(meta.num_sampled, dtype=bool))
    sched.settle_released()
    for i in range(burst):
        add(i, 400)
    evictions = sched.prefix_cache_stats()["evictions"]
    calls[0] = 0
    gc.freeze()
    start = time.thread_time_ns()
    plan = sched.schedule()
    writer.write(plan, staging.next_buffer())
    cpu = time.thread_time_ns() - start
    gc.unfreeze()
    assert plan.num_admitted == burst
    return cpu / 1e3 / burst, sched.prefix_cache_stats()["evictions"] - evictions, calls[0]


def main() -> None:
    for burst in (64, 256):
        runs = [one(seed, burst) for seed in range(7)]
        print(f"burst {burst}: {min(r[0] for r in runs):6.2f} us a request (launch-path CPU), "
              f"{runs[0][1]} blocks evicted, {runs[0][2]} array batches")


if __name__ == "__main__":
    main()
