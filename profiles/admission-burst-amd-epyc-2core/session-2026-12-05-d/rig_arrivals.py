"""Engine-sized rig: the 256 arrivals of a burst queued at once before its first step ("all"), or 64 before each
admitting step ("per-step"); planner CPU of each admitting step.  python rig_arrivals.py all|per-step"""
import gc
import sys

import numpy as np

sys.path.insert(0, "scripts")
from bench_admission import PlannerRig

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.core import planner_writer
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.sampling_params import SamplingParams

mode = sys.argv[1]  # "all": 256 adds before the first step; "per-step": 64 adds before each admitting step
rows, budget = 256, 2048
blocks = BlockManager(46602, 16, rows, 512, prefix_caching=True)
sch = Scheduler(blocks, budget, eos_token_id=2)
rig = PlannerRig(sch, planner_writer(sch, 49152), StagingPair(budget, rows, 512, pinned=False), [], np.full(rows, 7, dtype=np.int64), np.ones(rows, dtype=bool))
rng = np.random.default_rng(0)
gc.collect(); gc.freeze()
seq = 0
def add(n):
    global seq
    for _ in range(n):
        seq += 1
        sch.add(Request(str(seq), seq, rng.integers(256, 30000, 32).tolist(), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), seq, 0.0))
for burst in range(6):
    left = 256
    if mode == "all":
        add(256); left = 0
    steps = []
    while sch.has_work() or left:
        if left:
            k = min(64, left); add(k); left -= k
        plan = rig.step()
        if plan.num_admitted:
            steps.append((plan.num_admitted, round(plan.admit_cpu_s * 1e6)))
    sch.settle_released()
    if burst: print(mode, burst, steps)
