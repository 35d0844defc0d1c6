"""A burst's first admitting step against its next ones, on the engine-sized planner rig (one thread: a scheduler,
metadata writer and staging pair shaped like the sim engine's, 256 rows, 2,048 tokens a step, 46,602 blocks of 16,
512 a row, prefix caching; warmed up by ``warm_up_planner`` as the engine's planner thread is; fake tokens). Bursts
of 256 requests (32-token prompts, 48 outputs) arrive at the idle rig one after another; per admitting step (0 = a
burst's first) the planner CPU per admitted request (``StepPlan.admit_cpu_s``, what ``stats()`` sums).

* ``gc``: the collector on after the freeze, as in the engine's core process; every GC pass inside each admitting
  step (generation, us) and the passes the arrivals (``Scheduler.add``) trigger;
* ``prewarm [--gc]``: every other burst is preceded by ``warm_up_planner`` on throwaway objects (untimed) just
  before its arrivals; the collector off after the freeze unless ``--gc`` (so that the rehearsal's garbage is not
  collected inside a timed step).

    python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-e/first_step.py gc
    python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-e/first_step.py prewarm [--gc]
"""
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_admission import PlannerRig

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.core import planner_writer
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.planner_warmup import warm_up_planner
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.sampling_params import SamplingParams

ROWS, BUDGET, VOCAB = 256, 2048, 49152


def rehearse() -> None:
    warm_up_planner(16, ROWS, BUDGET, True, lambda s: planner_writer(s, VOCAB), eos_token_id=2)


def build_rig() -> PlannerRig:
    blocks = BlockManager(46602, 16, ROWS, 512, prefix_caching=True)
    scheduler = Scheduler(blocks, BUDGET, eos_token_id=2)
    rig = PlannerRig(scheduler, planner_writer(scheduler, VOCAB), StagingPair(BUDGET, ROWS, 512, pinned=False), [],
                     np.full(ROWS, 7, dtype=np.int64), np.ones(ROWS, dtype=bool))
    rehearse()
    gc.collect()
    gc.freeze()
    return rig


def run_burst(rig: PlannerRig, first_seq: int, rng: np.random.Generator, on_step=None) -> list[float]:
    """Queue 256 requests, run them to their end; each admitting step's planner CPU us per admitted request."""
    for seq in range(first_seq, first_seq + 256):
        rig.scheduler.add(Request(str(seq), seq, rng.integers(256, 30000, 32).tolist(),
                                  SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), seq, 0.0))
    steps = []
    while rig.scheduler.has_work():
        if on_step is not None:
            on_step()
        plan = rig.step()
        if plan.num_admitted:
            steps.append(plan.admit_cpu_s * 1e6 / plan.num_admitted)
    rig.scheduler.settle_released()
    return steps


def gc_passes() -> None:
    rig = build_rig()
    passes: list[tuple[int, float]] = []
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes.append((info["generation"], round((time.perf_counter() - started[0]) * 1e6)))

    gc.callbacks.append(callback)
    rng = np.random.default_rng(0)
    by_step: dict[int, list[tuple[float, list]]] = {}
    for burst in range(10):
        passes.clear()
        segments: list[list] = []  # the passes before each step began: the arrivals', then each step's
        steps = run_burst(rig, burst * 256, rng, lambda segments=segments: (segments.append(list(passes)),
                                                                            passes.clear()))
        segments.append(list(passes))
        arrivals, per_step = segments[0], segments[1:]
        admitting = per_step[:len(steps)]  # a burst's admitting steps are its first ones
        if burst >= 2:
            for k, (us, found) in enumerate(zip(steps, admitting)):
                by_step.setdefault(k, []).append((us, found))
            if burst < 5:
                print(f"burst {burst}: the arrivals' GC passes (generation, us) {arrivals}")
    for k, values in sorted(by_step.items()):
        print(f"admitting step {k}: {statistics.median(us for us, _ in values):.2f} us a request; GC passes in it: "
              f"{[found for _, found in values]}")


def prewarm(collector_on: bool) -> None:
    rig = build_rig()
    if not collector_on:
        gc.disable()
    rng = np.random.default_rng(0)
    results: dict[bool, list[list[float]]] = {True: [], False: []}
    for burst in range(16):
        rehearsed = burst % 2 == 1
        if rehearsed:
            rehearse()
        steps = run_burst(rig, burst * 256, rng)
        if burst >= 2:
            results[rehearsed].append(steps[:3])
    for rehearsed in (False, True):
        firsts = [statistics.median(s[k] for s in results[rehearsed]) for k in range(3)]
        print(f"rehearsal just before the burst {'yes' if rehearsed else 'no '}: first step {firsts[0]:.2f} us a request, "
              f"second {firsts[1]:.2f}, third {firsts[2]:.2f} (medians of {len(results[rehearsed])} bursts)")


if __name__ == "__main__":
    if sys.argv[1] == "gc":
        gc_passes()
    else:
        prewarm("--gc" in sys.argv)
