"""Planner critical path per step in steady decode: this tree against an older commit, side by side.

    python scripts/bench_planner.py                    # this tree only
    python scripts/bench_planner.py --ref 8a388b8      # and the per-request planner of 8a388b8

The critical path is what the planner thread does between two launches:
``Scheduler.schedule``, ``StepMetadataWriter.write`` into a host staging
buffer, ``release_drained``, and ``Scheduler.apply`` of the step's sampled
tokens. ``n`` requests (prompts of 50-149 tokens, block size 16,
``max_tokens`` 4000, greedy, ignore_eos) are prefilled, then ~300 decode steps
are timed one by one (``perf_counter_ns``; GC enabled, ``gc.freeze()`` after
set-up as the engine does). Each implementation runs in its own process, the
reference in a temporary ``git worktree add --detach`` of ``--ref``, sizes
interleaved so that load from other users of the machine hits both alike;
each is run ``--repeat`` times and the run with the lowest median is shown.

Expectations written before the rewrite was measured (8a388b8 at 256 running
took ~1.3-2 ms; at 1024 ~12 ms):

- 8a388b8 is O(n) Python: a ``ScheduledRow`` and a ``_refresh`` per row, a
  per-row apply loop; ~5 us per row, so ~1.3 ms at 256 and ~10 ms at 2048.
- The array planner pays a fixed ~40 numpy calls (~1-3 us each: ~80 us)
  plus ~50-150 ns per row of vectorized gathers/scatters; rows crossing a
  block boundary (1/16 per step) are vectorized too. Expected ~0.1 ms at 256
  (>10x) and ~0.3-0.4 ms at 2048 (>25x), where copying ``[n, blocks]`` of
  decode block tables every step would dominate unless only grown rows are
  copied into a staging buffer that already holds the same rows.

Measured (AMD EPYC, 2-core shared VM, Python 3.11, numpy 2.4; best of 3, median
per step): 8a388b8 took 0.81 ms at 256, 3.7 ms at 1024 and 9.2 ms at 2048
(3-4.5 us per row, as expected); the array planner 56 us at 16, 65 us at 256,
95 us at 1024 and 168 us at 2048 (12.6x, 39x and 55x). Better than expected
at 2048 because three per-step costs found on the way went to O(changes):
the slot mapping (a gather from the wide block table, 34 us at 2048) became a
gather from a per-row slot base (5 us); copying the grown rows' whole block
tables (53 us) became one entry per grown row; new blocks come off an array
free list in one slice instead of list pops and three list-to-array
conversions (~50 -> ~10 us). What remains at 2048 is ~40 numpy calls of fixed
cost plus the output-history scatter (~20 us: one cache line per row). Not
measured here: steps where requests finish and arrive, which rewrite the
decode part of both staging buffers (0.3 ms at 256 and 0.7-0.8 ms at 2048
with ~7 arrivals per step, against 1.6 and 9.8 ms for 8a388b8).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from harness.common import COMMON, ROOT, ref_worktree, run_in_tree

SIZES = (16, 64, 256, 1024, 2048)
BLOCK_SIZE = 16
MAX_BLOCKS_PER_SEQ = 512  # 8192-token contexts
STAGES = ("schedule", "write", "release", "apply")


def build(api: str, n: int):
    """A planner with ``n`` requests past their prefill: (scheduler, writer, staging pair)."""
    from asyncbatch.engine.block_manager import BlockManager
    from asyncbatch.engine.host_staging import StagingPair
    from asyncbatch.engine.request import Request
    from asyncbatch.engine.scheduler import Scheduler
    from asyncbatch.engine.step_metadata import StepMetadataWriter
    from asyncbatch.sampling_params import SamplingParams

    budget = max(2048, n)
    num_blocks = n * MAX_BLOCKS_PER_SEQ // 4
    if api == "new":
        blocks = BlockManager(num_blocks, BLOCK_SIZE, n, MAX_BLOCKS_PER_SEQ)
        scheduler = Scheduler(blocks, budget)
        writer = StepMetadataWriter(scheduler.rows, blocks)
    else:  # 8a388b8: requests own block lists, the writer owns the block table
        blocks = BlockManager(num_blocks, BLOCK_SIZE)
        scheduler = Scheduler(blocks, n, budget)
        writer = StepMetadataWriter(n, MAX_BLOCKS_PER_SEQ, BLOCK_SIZE)
    staging = StagingPair(budget, n, MAX_BLOCKS_PER_SEQ, pinned=False)
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    for i in range(n):
        scheduler.add(Request(f"r{i}", i, [5] * (50 + i % 100), params, i, 0.0))
    return scheduler, writer, staging


def measure(api: str, n: int, steps: int) -> dict:
    import numpy as np

    scheduler, writer, staging = build(api, n)
    tokens, finite = np.full(n, 7, dtype=np.int64), np.ones(n, dtype=bool)
    clock = time.perf_counter_ns

    def step() -> tuple[int, int, int, int, int]:
        t0 = clock()
        plan = scheduler.schedule()
        t1 = clock()
        meta = writer.write(plan, staging.next_buffer())
        t2 = clock()
        scheduler.release_drained(plan)
        t3 = clock()
        r = meta.num_sampled
        scheduler.apply(plan, tokens[:r], finite[:r])
        t4 = clock()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, plan.num_decode

    for _ in range(10_000):  # prefill, then a few decode steps of warm-up
        if step()[4] == n:
            break
    for _ in range(10):
        step()
    gc.collect()
    gc.freeze()
    samples = [step() for _ in range(steps)]
    gc.unfreeze()
    if any(s[4] != n for s in samples):
        raise RuntimeError("not a steady decode: some step decoded fewer than all requests")
    total = sorted(sum(s[:4]) / 1e3 for s in samples)  # us
    out = {"n": n, "median_us": statistics.median(total), "p90_us": total[int(0.9 * (len(total) - 1))]}
    for i, name in enumerate(STAGES):
        out[f"{name}_us"] = statistics.median(s[i] / 1e3 for s in samples)
    return out


def run_child(tree: Path, api: str, n: int, steps: int) -> dict:
    done = run_in_tree(tree, Path(__file__), ["--child", api, "--sizes", str(n), "--steps", str(steps)])
    if done.returncode:
        raise RuntimeError(f"{api} planner at {n} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="commit with the per-request planner to compare against, e.g. 8a388b8")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="running requests, comma-separated")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per size")
    parser.add_argument("--repeat", type=int, default=3,
                        help="processes per size and implementation; the run with the lowest median is shown")
    parser.add_argument("--ref-api", choices=("old", "new"), default="old",
                        help="the planner API at --ref: old (per-request, up to 8a388b8) or new (array planner)")
    parser.add_argument("--child", choices=("new", "old"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        print(json.dumps(measure(args.child, sizes[0], args.steps)))
        return

    with contextlib.ExitStack() as stack:
        ref_tree = (stack.enter_context(ref_worktree(args.ref, [Path(__file__), COMMON, COMMON.with_name("__init__.py")]))
                    if args.ref else None)
        rows = []
        for n in sizes:
            runs: dict[str, list[dict]] = {"new": [], "old": []}
            for _ in range(args.repeat):  # interleaved, so that a burst of load hits both
                runs["new"].append(run_child(ROOT, "new", n, args.steps))
                if ref_tree:
                    runs["old"].append(run_child(ref_tree, args.ref_api, n, args.steps))
            best = {api: min(r, key=lambda m: m["median_us"]) if r else None for api, r in runs.items()}
            rows.append((n, best["new"], best["old"]))
            print(f"  measured {n} running", file=sys.stderr)

    import numpy as np

    from asyncbatch.profiling.host_info import cpu_name

    print(f"planner critical path per decode step (schedule + write + release_drained + apply), "
          f"{args.steps} steps, block size {BLOCK_SIZE}, best of {args.repeat} processes")
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}, "
          f"numpy {np.__version__}; times in us")
    head = f"{'running':>8} | {'new median':>10} {'new p90':>8}"
    if ref_tree:
        head += f" | {args.ref + ' median':>16} {'p90':>8} | {'speedup':>7}"
    head += " | new: " + " / ".join(STAGES)
    print(head)
    for n, new, old in rows:
        line = f"{n:>8} | {new['median_us']:>10.1f} {new['p90_us']:>8.1f}"
        if old:
            line += f" | {old['median_us']:>16.1f} {old['p90_us']:>8.1f} | {old['median_us'] / new['median_us']:>6.1f}x"
        line += " | " + " / ".join(f"{new[f'{s}_us']:.0f}" for s in STAGES)
        print(line)
    if ref_tree:
        print(f"{args.ref} by stage (median us): " + "; ".join(
            f"{n}: " + " / ".join(f"{old[f'{s}_us']:.0f}" for s in STAGES) for n, _, old in rows))


if __name__ == "__main__":
    main()
