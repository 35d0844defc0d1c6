"""Does a dry rehearsal right before a burst take away its first admitting step's premium? On the engine-sized rig
(one thread, 256 rows, 2,048 tokens a step, 46,602 blocks), 16 bursts of 256 (32-token prompts, 48 outputs);
every other burst is preceded by ``warm_up_planner`` on throwaway objects (untimed), just before its arrivals.
Per burst the planner CPU per admitted request of its first three admitting steps; medians of bursts 2-15.
``--gc``: the collector left on after the freeze (the default here is off, so that the rehearsal's garbage is not
collected inside a timed step).

    python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-e/rig_prewarm.py [--gc]
"""
import gc, sys, time, statistics
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
import numpy as np
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
warm_up_planner(16, rows, budget, True, lambda s: planner_writer(s, vocab), eos_token_id=2)
gc.collect(); gc.freeze()
if "--gc" not in sys.argv:
    gc.disable()
rng = np.random.default_rng(0)
seq = 0
res = {True: [], False: []}
OUT = 48  # outputs per request: shorter decode phases, more bursts
for b in range(16):
    pre = b % 2 == 1
    if pre and b:
        warm_up_planner(16, rows, budget, True, lambda s: planner_writer(s, vocab), eos_token_id=2)
    for _ in range(256):
        seq += 1
        sch.add(Request(str(seq), seq, rng.integers(256, 30000, 32).tolist(),
                        SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True), seq, 0.0))
    steps = []
    while sch.has_work():
        plan = rig.step()
        if plan.num_admitted:
            steps.append(plan.admit_cpu_s * 1e6 / plan.num_admitted)
    sch.settle_released()
    if b >= 2:
        res[pre].append(steps[:3])
for pre in (False, True):
    first = [s[0] for s in res[pre]]; second = [s[1] for s in res[pre]]; third = [s[2] for s in res[pre]]
    print(f"rehearsal before the burst {pre!s:5}: first step {statistics.median(first):.2f} us/req, second {statistics.median(second):.2f}, third {statistics.median(third):.2f} (medians of {len(first)})")
