"""Every admitting step of a 256-request burst through LLM on sim (1 ms steps, 40-token outputs), two fresh
engines: admitted requests, admit_ms (StepRecord), schedule and write wall us, whether the planner was idle
before it. python engine_admission_steps.py 256 40"""
import sys, time
import numpy as np
from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams
n = int(sys.argv[1]); out = int(sys.argv[2])
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
for proc in range(2):
  with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=n, seed=0) as llm:
    rng = np.random.default_rng(proc)
    prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(n)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0); llm.reset_stats()
    llm.generate(prompts, [SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True, seed=i) for i in range(n)], use_tqdm=False)
    llm.wait_settled(5.0)
    recs = [r for r in llm.timeline.window() if r.num_admitted]
    print(proc, round(llm.stats()["admission_us_per_request"], 2))
    for r in recs:
        print("   adm", r.num_admitted, "admit_us", round(r.admit_ms*1e3), "sched_us", round((r.schedule_end-r.plan_start)*1e6), "write_us", round((r.plan_end-r.fence_end)*1e6), "gc_ms", round(r.gc_ms, 3), "idle_before", r.after_idle, "dec", r.num_decode)
