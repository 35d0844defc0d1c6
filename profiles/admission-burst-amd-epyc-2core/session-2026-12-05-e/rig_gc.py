"""The collector's passes inside each admitting step of a burst, on the engine-sized rig (one thread, 256 rows,
2,048 tokens a step, 46,602 blocks): 10 bursts of 256 (32-token prompts, 48 outputs), the collector on after the
freeze as in the engine's core process; per admitting step (0 = a burst's first) the planner CPU per admitted
request and every GC pass inside it (generation, us), and the passes the arrivals (``Scheduler.add``) trigger.

    python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-e/rig_gc.py
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
passes = []; t0 = [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else: passes.append((info["generation"], (time.perf_counter() - t0[0]) * 1e6, info["collected"]))
gc.callbacks.append(cb)
rng = np.random.default_rng(0)
seq = 0
per = {}
for b in range(10):
    passes.clear()
    for _ in range(256):
        seq += 1
        sch.add(Request(str(seq), seq, rng.integers(256, 30000, 32).tolist(),
                        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), seq, 0.0))
    arrivals = list(passes); passes.clear()
    k = 0
    while sch.has_work():
        passes.clear()
        plan = rig.step()
        if plan.num_admitted:
            if b >= 2:
                per.setdefault(k, []).append((plan.admit_cpu_s * 1e6 / plan.num_admitted, list(passes)))
            k += 1
    sch.settle_released()
    if b >= 2 and b < 5:
        print(f"burst {b}: arrivals' GC passes {[(g, round(us)) for g, us, _ in arrivals]}")
for k in sorted(per):
    v = per[k]
    print(f"admitting step {k}: {statistics.median(x for x, _ in v):.2f} us/req; GC passes in it: {[[(g, round(us)) for g, us, _ in p] for _, p in v]}")
