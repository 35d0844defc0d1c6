"""A fresh process's first admission bursts on an engine-sized planner rig, with and without ``warm_up_planner``.

    python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-d/rig_first_burst.py [PAIRS]

Each run is a fresh interpreter (``--child``): a scheduler, metadata writer and staging pair shaped like the sim
engine's (256 rows, 2,048 tokens a step, 46,602 blocks of 16, 512 a row, prefix caching), optionally warmed up by
``asyncbatch.engine.planner_warmup.warm_up_planner`` as the engine's planner thread does, then three bursts of 256
requests (32-token prompts, 400 outputs, fake tokens) each run to its end on the one thread; per burst the planner
CPU per admitted request (``StepPlan.admit_cpu_s``, what ``stats()`` sums) and each admitting step's CPU us.
Warm-up on and off alternate.
"""
import gc
import statistics
import subprocess
import sys


def child(warm: bool) -> None:
    import numpy as np

    sys.path.insert(0, "scripts")
    from bench_admission import PlannerRig

    from asyncbatch.engine.block_manager import BlockManager
    from asyncbatch.engine.core import planner_writer
    from asyncbatch.engine.host_staging import StagingPair
    from asyncbatch.engine.planner_warmup import warm_up_planner
    from asyncbatch.engine.request import Request
    from asyncbatch.engine.scheduler import Scheduler
    from asyncbatch.sampling_params import SamplingParams

    rows, budget, vocab = 256, 2048, 49152
    blocks = BlockManager(46602, 16, rows, 512, prefix_caching=True)
    sch = Scheduler(blocks, budget, eos_token_id=2)
    rig = PlannerRig(sch, planner_writer(sch, vocab), StagingPair(budget, rows, 512, pinned=False), [],
                     np.full(rows, 7, dtype=np.int64), np.ones(rows, dtype=bool))
    if warm:
        warm_up_planner(16, rows, budget, True, lambda s: planner_writer(s, vocab), eos_token_id=2)
    gc.collect()
    gc.freeze()
    rng = np.random.default_rng(0)
    seq = 0
    for _ in range(3):
        for _ in range(256):
            seq += 1
            sch.add(Request(str(seq), seq, rng.integers(256, 30000, 32).tolist(),
                            SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), seq, 0.0))
        steps = []
        while sch.has_work():
            plan = rig.step()
            if plan.num_admitted:
                steps.append((plan.num_admitted, round(plan.admit_cpu_s * 1e6)))
        sch.settle_released()
        print(f"{sum(c for _, c in steps) / sum(a for a, _ in steps):.3f} {steps}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2] == "1")
        sys.exit(0)
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    figures: dict[bool, list[list[float]]] = {True: [], False: []}
    for i in range(pairs):
        for warm in (True, False) if i % 2 == 0 else (False, True):
            out = subprocess.run([sys.executable, __file__, "--child", "1" if warm else "0"], capture_output=True,
                                 text=True, check=True).stdout.splitlines()
            figures[warm].append([float(line.split()[0]) for line in out])
            print(f"pair {i} warm-up {'on ' if warm else 'off'}: " + " | ".join(out), flush=True)
    for warm in (True, False):
        for b in range(3):
            values = [f[b] for f in figures[warm]]
            print(f"warm-up {'on ' if warm else 'off'}, burst {b}: median {statistics.median(values):.2f} us a request "
                  f"(min {min(values):.2f}, max {max(values):.2f})")
