"""Admission CPU per request of repeated 256-request bursts through one engine (sim, 1 ms steps, engine process).

    PYTHONPATH=<tree> python bursts.py BURSTS [PROMPT_LEN] [SEED]      # prints a JSON list, one figure a burst

Each burst: 256 new prompts of PROMPT_LEN (32) random token ids, 100 greedy tokens each (ignore_eos), after a
four-request warm-up; the figure is ``stats()["admission_cpu_us_per_request"]`` after ``reset_stats()``.
``PIN=1``: the core process's threads on CPU 1 and this (frontend) process's on CPU 0 after the warm-up.
"""
import json
import multiprocessing
import os
import sys

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams

N = 256
BURSTS, PLEN = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 32
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
rng = np.random.default_rng(int(sys.argv[3]) if len(sys.argv) > 3 else 0)


def pin(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):  # every thread: sched_setaffinity(pid) moves only one
        os.sched_setaffinity(int(tid), cpus)


out = []
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=N, seed=0) as llm:
    llm.generate([rng.integers(256, 30000, PLEN).tolist() for _ in range(4)],
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0)
    if os.environ.get("PIN"):
        core = next(p.pid for p in multiprocessing.active_children() if p.name == "asyncbatch-core")
        pin(core, {1})
        pin(os.getpid(), {0})
    params = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, seed=i) for i in range(N)]
    for _ in range(BURSTS):
        llm.reset_stats()
        llm.generate([rng.integers(256, 30000, PLEN).tolist() for _ in range(N)], params, use_tqdm=False)
        llm.wait_settled(5.0)
        out.append(llm.stats()["admission_cpu_us_per_request"])
print(json.dumps(out))
