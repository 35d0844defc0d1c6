"""Admission CPU per request of 256-request bursts, per placement of the core process's threads: needs probe.diff
(``ASYNCBATCH_PROBE_PIN`` names the threads that pin themselves to CPU 1: planner, main, sender, device).

    PYTHONPATH=<tree with probe.diff> python pin_arms.py ROUNDS BURSTS ["arm;arm;..."]

probe.diff applies to e7b13ac (the tree these runs measured), not to later admission code.

Each arm: a fresh engine (the core process adopts the caller's environment), a four-request warm-up, then BURSTS
bursts of 256 new 32-token prompts, 100 tokens each; arms alternate, reversed every other round.
"""
import os
import statistics
import sys

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams

ARMS = sys.argv[3].split(";") if len(sys.argv) > 3 else [
    "", "planner", "planner,main", "planner,main,sender", "planner,main,sender,device"]
N, BURSTS = 256, int(sys.argv[2]) if len(sys.argv) > 2 else 3
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
cost: dict[str, list[float]] = {a: [] for a in ARMS}
busy: dict[str, list[float]] = {a: [] for a in ARMS}
rng = np.random.default_rng(0)
for rnd in range(int(sys.argv[1])):
    for arm in (ARMS if rnd % 2 == 0 else ARMS[::-1]):
        os.environ["ASYNCBATCH_PROBE_PIN"] = arm
        with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=N, seed=0) as llm:
            warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            llm.generate([rng.integers(256, 30000, 32).tolist() for _ in range(4)], warm, use_tqdm=False)
            llm.wait_settled(5.0)
            params = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, seed=i) for i in range(N)]
            for _ in range(BURSTS):
                llm.reset_stats()
                llm.generate([rng.integers(256, 30000, 32).tolist() for _ in range(N)], params, use_tqdm=False)
                llm.wait_settled(5.0)
                stats = llm.stats()
                cost[arm].append(round(stats["admission_cpu_us_per_request"], 2))
                busy[arm].append(round(stats["device_busy_fraction"], 4))
for arm in ARMS:
    print(f"{arm or 'free':32s} admission cpu us/request median {statistics.median(cost[arm]):.2f}  "
          f"busy median {statistics.median(busy[arm]):.4f}  all {cost[arm]}")
