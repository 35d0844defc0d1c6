"""Admission bursts and the frontend's token rate on ``sim``: this tree against an older one, side by side.

    python scripts/bench_admission.py --ref-tree /tmp/wt-admit      # a worktree of the commit before
    python scripts/bench_admission.py --ref HEAD                     # or let the script make one
    python scripts/bench_admission.py --quick                        # this tree only, one repeat

Three measurements, each run in a fresh interpreter per tree (``PYTHONPATH`` = the tree, the same copy of
this script), trees interleaved and each case repeated ``--repeat`` times so that load from other users of
the machine hits both alike; medians are shown, with every repeat in the JSON (``--json``):

- ``planner``: the planner's work for the step that admits a burst, timed with ``perf_counter_ns``:
  ``Scheduler.schedule`` + ``StepMetadataWriter.write`` + ``release_drained`` for ``--burst`` requests
  (32-token prompts, prefix caching on, as the engine's default) arriving at an idle scheduler (warmed
  up by one earlier burst, so no first-touch page faults; GC frozen as in the engine), and
  the same for the 64 admitted into a scheduler that decodes 192 (a burst as the token budget meters
  it out: the steps after the first). Each timed step follows a ``gc.collect()``, which leaves the caches
  colder than the engine's planner finds them after sleeping through a step (13 small numpy calls: ~10 us
  warm, ~16 us after a 1 ms sleep, ~180-220 us after the collect on the 2-core Intel VM;
  ``profiles/admission-burst-intel-xeon-2core/admission-table/cold_state.py``): a worst case, whose
  fixed per-step part weighs most in the 64-request figures. Per admitted request, wall clock and the thread's CPU time
  (``thread_time_ns``: what the work costs when the machine's other load preempts the process); best
  of 7 in each process; ``*_launch_cpu_us``: the part before the launch (the critical path; a tree whose
  core calls ``release_drained`` after the launch leaves it out); ``metered_burst_marginal_launch_cpu_us``:
  that less the launch CPU of the 192 rows' decode step alone, measured just before the burst arrives (what
  admitting the 64 adds to a step the planner plans anyway).
- ``burst``: the issue's workload through ``LLM`` (engine process, overlap): 256 requests at once,
  32-token prompts, 400-token outputs (ignore_eos), ``max_num_seqs`` 256, sim 1 ms per step; whole-run
  busy fraction from the gap report (first device start to last device end), its largest gap, the idle
  time's planning and output shares, output ms per step, and ``admission_us_per_request`` (wall) and
  ``admission_cpu_us_per_request`` (the planner thread's CPU time) from
  ``stats()`` where the tree has it: the first burst of a fresh engine process (after a four-request warm-up);
  ``later_admission_cpu_us_per_request``, the median of ``--later-bursts`` (2) more bursts of new prompts through the
  same engine (each evicting the one before from the prefix cache), is that engine once it has served.
- ``running``: the same with 1,024 requests and ``max_num_seqs`` 1,024 (1,024 running at 1 ms), with a
  tokenizer and with ``skip_tokenizer_init`` (token ids only: no detokenizer runs).
- ``cache``: the planner's admission step where the prefix cache matters, launch-path CPU per request, warm, best
  of 7: ``full_cache``, ``--burst`` new prompts into a cache whose every block a first wave left cached (each
  admission evicts: what a server that has run a while sees), with the array batches it took; ``shared_prefix``,
  96 prompts of a cached 64-token prefix and 16 tokens of their own (each admission a hit on 4 blocks), and
  ``no_shared_prefix``, the same prompts sharing nothing (the cache full enough that part of them evict).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.common import COMMON, ROOT, cpu_seconds, ref_worktree, run_in_tree

PROMPT_LEN = 32


def planner_case(burst: int, decoding: int) -> tuple[float, ...]:
    """us per admitted request of the planner's work for one admission step: (wall, thread CPU, thread CPU
    before the launch, that less the launch CPU of a step of the same ``decoding`` rows alone), best of 7."""
    runs = [_admission_step(burst, decoding, seed) for seed in range(7)]
    return tuple(min(r[k] for r in runs) for k in range(4))


def _timed_step(scheduler, writer, staging, collect: bool = True) -> tuple[object, object, int, int, int]:
    """Plan, write and release one step, GC frozen as in the engine after warm-up: (plan, meta, wall ns, thread
    CPU ns before the launch, thread CPU ns in all). What delays the launch: trees whose core releases drained
    requests after the launch (it has ``settle_released``) launch after schedule + write; older ones after
    release_drained too. ``collect``: a ``gc.collect()`` first (the caches colder than the engine finds them)."""
    if collect:
        gc.collect()
    gc.freeze()
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    plan = scheduler.schedule()
    meta = writer.write(plan, staging.next_buffer())
    c1 = time.thread_time_ns()
    scheduler.release_drained(plan)
    elapsed, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
    gc.unfreeze()
    return plan, meta, elapsed, (c1 - c0) if hasattr(scheduler, "settle_released") else cpu, cpu


@dataclass
class PlannerRig:
    """A scheduler and metadata writer warmed up as in an engine that has served before, ``decoding`` rows in their
    decode phase, and the ``burst`` requests about to arrive (not added yet)."""

    scheduler: object
    writer: object
    staging: object
    burst: list
    tokens: object
    finite: object

    def apply(self, plan, meta) -> None:
        self.scheduler.apply(plan, self.tokens[:meta.num_sampled], self.finite[:meta.num_sampled])

    def step(self):
        """Plan, write, release and apply one step (untimed); returns its plan."""
        plan = self.scheduler.schedule()
        meta = self.writer.write(plan, self.staging.next_buffer())
        self.scheduler.release_drained(plan)
        self.apply(plan, meta)
        return plan


def _rig(num_blocks: int, rows: int) -> PlannerRig:
    """A scheduler with prefix caching on (16-token blocks, 32 a row) over ``num_blocks`` blocks and ``rows`` token
    rows, its metadata writer and staging pair; no requests yet."""
    import numpy as np

    from asyncbatch.engine.block_manager import BlockManager
    from asyncbatch.engine.host_staging import StagingPair
    from asyncbatch.engine.scheduler import Scheduler
    from asyncbatch.engine.step_metadata import StepMetadataWriter

    blocks = BlockManager(num_blocks, 16, rows, 32, prefix_caching=True)
    scheduler = Scheduler(blocks, max(8192, rows), eos_token_id=2)
    return PlannerRig(scheduler, StepMetadataWriter(scheduler.rows, blocks),
                      StagingPair(max(8192, rows), rows, 32, pinned=False), [], np.full(rows, 7, dtype=np.int64),
                      np.ones(rows, dtype=bool))


def planner_rig(burst: int, decoding: int, seed: int) -> PlannerRig:
    """The planner case's set-up (also ``profiles/admission-burst-intel-xeon-2core/admission-table/planner_parts.py``):
    32-token prompts, prefix caching on, every row, block and staging page touched once by a warm-up."""
    import numpy as np

    from asyncbatch.engine.request import Request
    from asyncbatch.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    n = burst + decoding
    rig = _rig(n * 32 + 1, n)
    scheduler = rig.scheduler

    def request(i: int) -> Request:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, seed=i)
        return Request(str(i), i, rng.integers(256, 30000, PROMPT_LEN).tolist(), params, i, 0.0)

    # Warm-up: every row, block and staging page touched once, as in an engine that has served before.
    for i in range(n):
        warm = Request(f"w{i}", 10**6 + i, rng.integers(256, 30000, PROMPT_LEN).tolist(),
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), i, 0.0)
        scheduler.add(warm)
    while scheduler.has_work():
        rig.step()
    for i in range(decoding):
        scheduler.add(request(i))
    while decoding and rig.step().num_prefill:  # prefill them, then one decode step
        pass
    rig.burst = [request(decoding + i) for i in range(burst)]
    return rig


def _admission_step(burst: int, decoding: int, seed: int) -> tuple[float, float, float, float]:
    rig = planner_rig(burst, decoding, seed)
    scheduler, writer, staging = rig.scheduler, rig.writer, rig.staging
    # The same rows' decode step without an admission: what the admission step would cost the planner anyway.
    decode_ns = 0
    if decoding:
        plan, meta, _, decode_ns, _ = _timed_step(scheduler, writer, staging)
        rig.apply(plan, meta)
    for r in rig.burst:
        scheduler.add(r)
    plan, _, elapsed, launch_path, cpu = _timed_step(scheduler, writer, staging)
    if plan.num_prefill != burst:
        raise RuntimeError(f"admitted {plan.num_prefill} of {burst}")
    return elapsed / 1e3 / burst, cpu / 1e3 / burst, launch_path / 1e3 / burst, (launch_path - decode_ns) / 1e3 / burst


def cache_burst(seed: int, burst: int, prompt_len: int, num_blocks: int, shared_prefix: int = 0,
                cold: bool = False) -> tuple[float, int, int, int]:
    """One admission step of the ``cache`` case: a first wave of ``burst`` requests (one output each; with
    ``shared_prefix``, the first carries that many tokens of the prefix the second wave shares) runs to its end in a
    ``num_blocks`` cache, leaving its blocks cached; then ``burst`` prompts of ``prompt_len`` tokens arrive at the
    idle scheduler. Returns (launch-path CPU us a request, array batches (``Admitter._apply`` calls), blocks
    evicted, tokens reused from the cache) of the step that admits them; ``cold``: after ``gc.collect()``."""
    import numpy as np

    from asyncbatch.engine import admission
    from asyncbatch.engine.request import Request
    from asyncbatch.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    rig = _rig(num_blocks, burst)
    sched = rig.scheduler
    prefix = rng.integers(256, 30000, shared_prefix).tolist()

    def add(i: int, head: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        tail = rng.integers(256, 30000, prompt_len - len(head)).tolist()
        sched.add(Request(str(i), i, head + tail, params, i, 0.0))

    for i in range(burst):
        add(10**6 + i, prefix if i == 0 else [], 1)
    while sched.has_work():
        rig.step()
    sched.settle_released()
    for i in range(burst):
        add(i, prefix, 400)
    evictions = sched.prefix_cache_stats()["evictions"]
    batches = [0]
    apply = admission.Admitter._apply

    def counted(self, *args, **kwargs):
        batches[0] += 1
        return apply(self, *args, **kwargs)

    admission.Admitter._apply = counted
    try:
        plan, _, _, launch_path, _ = _timed_step(sched, rig.writer, rig.staging, collect=cold)
    finally:
        admission.Admitter._apply = apply
    if plan.num_admitted != burst:
        raise RuntimeError(f"admitted {plan.num_admitted} of {burst}")
    return (launch_path / 1e3 / burst, batches[0], sched.prefix_cache_stats()["evictions"] - evictions,
            sum(row.num_cached for row in plan.prefill))


def cache_case(burst: int) -> dict:
    full = [cache_burst(seed, burst, PROMPT_LEN, 2 * burst + 1) for seed in range(7)]
    shared = [cache_burst(seed, 96, 80, 96 * 8 + 64, shared_prefix=64) for seed in range(7)]
    distinct = [cache_burst(seed, 96, 80, 96 * 8 + 64) for seed in range(7)]
    return {"full_cache_launch_cpu_us": min(r[0] for r in full), "full_cache_array_batches": full[0][1],
            "shared_prefix_launch_cpu_us": min(r[0] for r in shared),
            "no_shared_prefix_launch_cpu_us": min(r[0] for r in distinct)}


def engine_case(num_requests: int, output_len: int, skip_tokenizer_init: bool, later_bursts: int = 2) -> dict:
    from asyncbatch.config import SimConfig
    from asyncbatch.llm import LLM
    from asyncbatch.profiling.gap_report import gap_report, lifetimes_of
    from asyncbatch.sampling_params import SamplingParams

    sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
    with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=num_requests, seed=0,
             skip_tokenizer_init=skip_tokenizer_init) as llm:
        import numpy as np

        rng = np.random.default_rng(0)
        prompts = [rng.integers(256, 30000, PROMPT_LEN).tolist() for _ in range(num_requests)]
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:4], warm, use_tqdm=False)
        llm.wait_settled(5.0)
        llm.reset_stats()
        params = [SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, seed=i)
                  for i in range(num_requests)]
        core = [p.pid for p in multiprocessing.active_children() if p.name == "asyncbatch-core"]
        load = os.getloadavg()[0]
        start, cpu, core_cpu = time.perf_counter(), time.process_time(), cpu_seconds(core)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        cpu, core_cpu = time.process_time() - cpu, cpu_seconds(core) - core_cpu
        llm.wait_settled(5.0)
        report = gap_report(llm, lifetimes_of(outputs))
        stats = llm.stats()
        later = [_later_burst(llm, rng, params) for _ in range(later_bursts)]
        shares = report.shares()
        largest = max((g.gap_ms for g in report.gaps), default=0.0)
        return {"busy": report.busy_fraction, "steps": stats["steps"], "wall_s": wall,
                "idle_ms_per_step": report.idle_ms_per_step, "largest_gap_ms": largest,
                # The first num_requests // 64 + 1 gaps of the run (the admission phase: the default token budget
                # admits 64 prompts of 32 tokens per step), and the gap before the last step.
                "burst_gaps_ms": sum(g.gap_ms for g in report.gaps[:num_requests // 64 + 1]),
                "last_gap_ms": report.gaps[-1].gap_ms if report.gaps else 0.0,
                "busy_ms": report.busy_ms, "idle_ms": report.idle_ms,
                "planning_share": shares.get("planning", 0.0), "output_share": shares.get("output", 0.0),
                "output_ms_per_step": stats["output_ms_per_step"], "planner_ms_per_step": stats["planner_ms_per_step"],
                "admission_us_per_request": stats.get("admission_us_per_request"),
                # The same in the planner thread's CPU time (trees that record it): what the code cost, less
                # what the machine's other work took from the planner meanwhile.
                "admission_cpu_us_per_request": stats.get("admission_cpu_us_per_request"),
                "detok_ms_per_step": stats.get("detok_ms_per_step"),
                # The same engine's later bursts (new prompts; each evicts the burst before from the prefix
                # cache): the admission cost of an engine that has served, without the first burst's cold start.
                "later_admission_cpu_us_per_request": statistics.median(later) if later else None,
                "later_admission_cpu_us_per_request_each": later,
                # What the two processes asked of the machine during generate(): CPU seconds per wall second
                # (2.0 = both cores), and the load average (other users included) when the run began.
                "frontend_cores": cpu / wall, "core_cores": core_cpu / wall, "load_avg": load}


def _later_burst(llm, rng, params: list) -> float:
    """One more burst of ``len(params)`` new prompts through ``llm`` after the measured one: its
    ``admission_cpu_us_per_request`` alone (0.0 for a tree without it)."""
    prompts = [rng.integers(256, 30000, PROMPT_LEN).tolist() for _ in range(len(params))]
    llm.reset_stats()
    llm.generate(prompts, params, use_tqdm=False)
    llm.wait_settled(5.0)
    return llm.stats().get("admission_cpu_us_per_request", 0.0)


def child(args: argparse.Namespace) -> dict:
    if args.child == "planner":
        (idle, idle_cpu, idle_launch, _), (metered, metered_cpu, metered_launch, metered_marginal) = (
            planner_case(args.burst, 0), planner_case(64, 192))
        return {"idle_burst_us": idle, "idle_burst_cpu_us": idle_cpu, "idle_burst_launch_cpu_us": idle_launch,
                "metered_burst_us": metered, "metered_burst_cpu_us": metered_cpu,
                "metered_burst_launch_cpu_us": metered_launch,
                "metered_burst_marginal_launch_cpu_us": metered_marginal}
    if args.child == "cache":
        return cache_case(args.burst)
    if args.child == "burst":
        return engine_case(256, 400, False, args.later_bursts)
    return engine_case(1024, 400, args.child == "running-ids", args.later_bursts)


CASES = ("planner", "cache", "burst", "running", "running-ids")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="commit to compare against (a temporary worktree is made)")
    parser.add_argument("--ref-tree", type=Path, help="an existing checkout to compare against")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--later-bursts", type=int, default=2,
                        help="bursts through each engine after the measured one (their median: later_admission_...)")
    parser.add_argument("--quick", action="store_true", help="one repeat, this tree only")
    parser.add_argument("--json", type=Path, help="write every repeat here")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    repeat = 1 if args.quick else args.repeat
    with contextlib.ExitStack() as stack:
        ref = args.ref_tree
        if ref is not None:  # the same measuring code on both sides
            for path in (Path(__file__), COMMON):
                shutil.copy2(path, ref / path.relative_to(ROOT))
        if args.ref and not args.quick:
            ref = stack.enter_context(ref_worktree(args.ref, [Path(__file__), COMMON, COMMON.with_name("__init__.py")]))
        trees = {"after": ROOT, **({"before": ref} if ref and not args.quick else {})}
        runs: dict[str, dict[str, list[dict]]] = {case: {name: [] for name in trees} for case in args.cases.split(",")}
        for case in runs:
            for _ in range(repeat):
                for name, tree in trees.items():  # interleaved
                    done = run_in_tree(tree, Path(__file__), ["--child", case, "--burst", str(args.burst),
                                                              "--later-bursts", str(args.later_bursts)], timeout_s=900)
                    if done.returncode:
                        raise RuntimeError(f"{case} in {tree} failed:\n{done.stderr[-3000:]}")
                    runs[case][name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(f"  {case} {name}: {runs[case][name][-1]}", file=sys.stderr, flush=True)
    print(f"load average before/after: see uptime; {os.cpu_count()} cores; medians of {repeat}")
    for case, by_tree in runs.items():
        keys = [k for k, v in by_tree["after"][0].items() if isinstance(v, (int, float))]
        print(f"\n{case}")
        for key in keys:
            cells = []
            for name in trees:
                values = [r[key] for r in by_tree[name] if isinstance(r.get(key), (int, float))]
                cells.append(f"{name} {statistics.median(values):10.4g}" if values else f"{name} {'-':>10}")
            print(f"  {key:28s} " + "   ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
