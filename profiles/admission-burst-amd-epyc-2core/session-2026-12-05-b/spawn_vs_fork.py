"""First-burst admission figure with the core started by the fork server (default) or spawned."""
import multiprocessing, sys
import numpy as np
import asyncbatch.engine.client as client
from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams
if sys.argv[1] == "spawn":
    client._context = multiprocessing.get_context("spawn")
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
rng = np.random.default_rng(0)
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0) as llm:
    llm.generate([rng.integers(256, 30000, 32).tolist() for _ in range(4)],
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0)
    figs = []
    for burst in range(3):
        llm.reset_stats()
        prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
        params = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, seed=i) for i in range(256)]
        llm.generate(prompts, params, use_tqdm=False)
        llm.wait_settled(5.0)
        figs.append(round(llm.stats()["admission_cpu_us_per_request"], 2))
    print(sys.argv[1], figs)
