"""The engine's admission cost (``stats()["admission_cpu_us_per_request"]``) over five bursts in one engine process:
the first burst after start (what ``scripts/bench_admission.py``'s ``burst`` case measures, after a four-request
warm-up) and the four after it (an engine that has served). sim at 1 ms steps, ``skip_tokenizer_init``, 256 distinct
32-token prompts a burst, 100-token greedy outputs, ``max_num_seqs`` 256, the default token budget (~60 admitted a
step). ``reset``: the prefix cache is emptied before each burst (every block fresh); ``full``: it is not (each
admission evicts blocks the burst before left cached, as in a server that has run a while).

    PYTHONPATH=<tree> python warm_bursts.py reset|full
"""
import statistics
import sys

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams

mode = sys.argv[1]
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
rng = np.random.default_rng(0)
figures = []
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0, skip_tokenizer_init=True) as llm:
    warm = [rng.integers(256, 30000, 32).tolist() for _ in range(4)]
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0)
    for burst in range(5):
        prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
        if mode == "reset":
            llm.reset_prefix_cache()
        llm.reset_stats()
        params = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, seed=i) for i in range(256)]
        llm.generate(prompts, params, use_tqdm=False)
        llm.wait_settled(5.0)
        steps = [(r.num_admitted, round(r.admit_cpu_ms * 1e3)) for r in llm.timeline.window() if r.num_admitted]
        figures.append(llm.stats()["admission_cpu_us_per_request"])
        print(f"burst {burst}: {figures[-1]:.2f} us a request; (admitted, planner CPU us) per step: {steps}")
print(f"{mode}: first burst {figures[0]:.2f}, later bursts median {statistics.median(figures[1:]):.2f} us a request")
