"""First and two later bursts of a fresh engine; argv: overlap|sync, warm-up requests, their max_tokens (the probes run this)."""
import sys

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams

overlap = sys.argv[1] == "overlap"
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
rng = np.random.default_rng(0)
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0, overlap=overlap) as llm:
    llm.generate([rng.integers(256, 30000, 32).tolist() for _ in range(int(sys.argv[2]))],
                 SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0)
    for burst in range(3):
        llm.reset_stats()
        prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
        params = [SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, seed=i) for i in range(256)]
        llm.generate(prompts, params, use_tqdm=False)
        llm.wait_settled(5.0)
        steps = [(r.num_admitted, round(r.admit_ms * 1e3), round(r.admit_cpu_ms * 1e3)) for r in llm.timeline.window() if r.num_admitted]
        s = llm.stats()
        print(f"{sys.argv[1]} burst {burst}: wall {s['admission_us_per_request']:.2f} cpu {s['admission_cpu_us_per_request']:.2f} (admitted, wall us, cpu us): {steps}")
