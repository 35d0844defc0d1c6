"""Issue 25's burst (256 requests of 32 tokens at once, sim 1 ms steps) in-process: each admitting step's
admitted count and its admission cost per request (planner thread CPU, then wall; ``StepRecord.admit_*``).

    python profiles/admission-burst-intel-xeon-2core/per-step/admit_steps.py      # from the repository root
"""
import time

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams

sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0, engine_process=False) as llm:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0)
    seen = len(llm.timeline.records)
    time.sleep(0.3)  # the burst arrives at an idle engine, as in the command
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, seed=i) for i in range(256)]
    llm.generate(prompts, params, use_tqdm=False)
    llm.wait_settled(5.0)
    steps = [r for r in llm.timeline.records[seen:] if r.num_admitted]
    for r in steps:
        print(f"admitted {r.num_admitted:4d}  cpu {r.admit_cpu_ms * 1e3 / r.num_admitted:6.2f} us/request  "
              f"wall {r.admit_ms * 1e3 / r.num_admitted:6.2f}")
    total = sum(r.num_admitted for r in steps)
    print(f"whole burst: {total} admitted, cpu {sum(r.admit_cpu_ms for r in steps) * 1e3 / total:.2f} us/request")
