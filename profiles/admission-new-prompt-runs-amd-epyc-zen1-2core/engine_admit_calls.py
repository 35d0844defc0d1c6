"""Each admitting step of an in-process ``sim`` engine (the planner thread of ``LLM(engine_process=False)``): requests
admitted and planner CPU per request, as ``Admitter.admit`` alone (a wrapper's ``thread_time``) and as the step's
record (``StepRecord.admit_cpu_ms``: ``admit`` plus the staging writes of the admitted prefill rows). Three bursts of
256 new 32-token prompts (40 tokens each), 1 ms steps, default token budget (2,048: 64 prompts a step).

    PYTHONPATH=<tree> python engine_admit_calls.py
"""
import time

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.engine import admission
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams

calls = []
original = admission.Admitter.admit


def admit(self, prefill, budget, drained):
    n0, c0 = self.num_admissions, time.thread_time()
    try:
        return original(self, prefill, budget, drained)
    finally:
        if self.num_admissions > n0:
            calls.append((self.num_admissions - n0, (time.thread_time() - c0) * 1e6))


admission.Admitter.admit = admit
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0, engine_process=False) as llm:
    rng = np.random.default_rng(0)
    for burst in range(3):
        prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
        params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, seed=i) for i in range(256)]
        calls.clear()
        llm.generate(prompts, params, use_tqdm=False)
        llm.wait_settled(5.0)
        records = [r for r in llm.timeline.window() if r.num_admitted]
        admit_us = sum(us for _, us in calls) / sum(n for n, _ in calls)
        step_us = sum(r.admit_cpu_ms for r in records) * 1e3 / sum(r.num_admitted for r in records)
        print(f"burst {burst}: admit() {admit_us:.2f} us/request, with the staging writes {step_us:.2f}; per step "
              f"(admitted, admit() us/request): {[(n, round(us / n, 1)) for n, us in calls[-5:]]}")
        llm.reset_stats()
