import time, statistics
from asyncbatch import LLM, SamplingParams, SimConfig
from asyncbatch.executors import sim_executor as se
acc = []
orig = se.SimExecutor._prepare
def timed(self, meta, handle):
    t = time.thread_time_ns(); r = orig(self, meta, handle); acc.append((time.thread_time_ns() - t) / 1e3); return r
se.SimExecutor._prepare = timed
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0, per_context_token_ns=0)
with LLM(device="sim", sim=sim, max_num_seqs=1024, max_num_batched_tokens=8192, engine_process=False) as llm:
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(32)] for i in range(1024)]
    llm.generate(prompts, [SamplingParams(max_tokens=200, ignore_eos=True, seed=i) for i in range(1024)], use_tqdm=False)
print("sim _prepare CPU us per step: median", round(statistics.median(acc), 1), "p90", round(sorted(acc)[int(len(acc)*0.9)], 1), "steps", len(acc))
