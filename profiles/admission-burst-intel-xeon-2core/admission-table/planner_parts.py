"""The planner's parts of one admission step (Scheduler.schedule + StepMetadataWriter.write), per admitted request,
medians over 9 seeds: ``Admitter.admit`` (of it ``Admitter._apply`` and ``RowState.admit_many``), ``write_prefill``,
the whole ``write`` and the whole step. The same set-up as ``scripts/bench_admission.py``'s planner case: 32-token
prompts, prefix caching on, every row warmed up once.

    PYTHONPATH=<tree> python planner_parts.py 64 192      # 64 admitted beside 192 decoding, after gc.collect()
    PYTHONPATH=<tree> python planner_parts.py 256 0 w     # 256 at an idle scheduler, no collect (warm)
"""

import gc
import statistics
import sys
import time

import numpy as np

from asyncbatch.engine import admission, prefill_metadata, row_state, step_metadata
from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.sampling_params import SamplingParams


def setup(burst: int, decoding: int, seed: int):
    rng = np.random.default_rng(seed)
    n = burst + decoding
    blocks = BlockManager(n * 32 + 1, 16, n, 32, prefix_caching=True)
    scheduler = Scheduler(blocks, max(8192, n), eos_token_id=2)
    writer = StepMetadataWriter(scheduler.rows, blocks)
    staging = StagingPair(max(8192, n), n, 32, pinned=False)
    tokens, finite = np.full(n, 7, dtype=np.int64), np.ones(n, dtype=bool)

    def request(i: int) -> Request:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, seed=i)
        return Request(str(i), i, rng.integers(256, 30000, 32).tolist(), params, i, 0.0)

    def step():
        plan = scheduler.schedule()
        meta = writer.write(plan, staging.next_buffer())
        scheduler.release_drained(plan)
        scheduler.apply(plan, tokens[:meta.num_sampled], finite[:meta.num_sampled])
        return plan

    for i in range(n):
        scheduler.add(Request(f"w{i}", 10**6 + i, rng.integers(256, 30000, 32).tolist(),
                              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), i, 0.0))
    while scheduler.has_work():
        step()
    for i in range(decoding):
        scheduler.add(request(i))
    while decoding and step().num_prefill:
        pass
    for i in range(burst):
        scheduler.add(request(decoding + i))
    return scheduler, writer, staging


def main() -> None:
    burst, decoding, warm = int(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3
    acc: dict[str, int] = {}

    def timed(f, label):
        def g(*a, **k):
            t = time.perf_counter_ns()
            r = f(*a, **k)
            acc[label] = acc.get(label, 0) + time.perf_counter_ns() - t
            return r
        return g

    admission.Admitter.admit = timed(admission.Admitter.admit, "admit")
    admission.Admitter._apply = timed(admission.Admitter._apply, "_apply")
    row_state.RowState.admit_many = timed(row_state.RowState.admit_many, "admit_many")
    step_metadata.StepMetadataWriter.write = timed(step_metadata.StepMetadataWriter.write, "write")
    step_metadata.write_prefill = timed(prefill_metadata.write_prefill, "write_prefill")
    runs = []
    for seed in range(9):
        scheduler, writer, staging = setup(burst, decoding, seed)
        acc.clear()
        if not warm:
            gc.collect()
        gc.freeze()
        t = time.perf_counter_ns()
        writer.write(scheduler.schedule(), staging.next_buffer())
        acc["total"] = time.perf_counter_ns() - t
        gc.unfreeze()
        runs.append(dict(acc))
    for k in runs[0]:
        us = statistics.median(r[k] for r in runs) / 1e3
        print(f"{k:14} {us / burst:6.2f} us/req  ({us:7.1f} us)")


if __name__ == "__main__":
    main()
