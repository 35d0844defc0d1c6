"""One request at a time on a workload's 4 one-request prompts (128 greedy tokens): the plain engine and ngram engines
at several num_speculative_tokens, all alive at once, interleaved (order reversed every other repeat); decode tok/s.

    python profiles/speculative-amd-epyc-zen4-2core/session-2026-12-05-c/k_sweep.py 0,4,6 3 [w8a8|int4]  # repo root
    (WL=open for the open-chat prompts; w8a8 runs float32 with compile_decode, int4 bfloat16 eager)
"""
import os
import statistics
import sys

sys.path.insert(0, "scripts")
from harness.speculative_workloads import load_workload, prompt_ids

from asyncbatch import LLM, SamplingParams

ks = [int(k) for k in sys.argv[1].split(",")]
repeats = int(sys.argv[2])
quant = sys.argv[3] if len(sys.argv) > 3 else "w8a8"
dtype = "float32" if quant == "w8a8" else "bfloat16"
engines = {k: LLM(None, device="cpu", dtype=dtype, quantization=quant, compile_decode=quant == "w8a8",
                  speculative_config={"method": "ngram", "num_speculative_tokens": k} if k else None,
                  num_threads=2, seed=0) for k in ks}
prompts = [prompt_ids(engines[ks[0]], it["messages"]) for it in load_workload(os.environ.get("WL", "grounded"))[:4]]
params = SamplingParams(max_tokens=128, temperature=0.0)
for llm in engines.values():
    llm.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
res: dict[int, list[float]] = {k: [] for k in ks}
for rep in range(repeats):
    for k in ks if rep % 2 == 0 else ks[::-1]:
        llm = engines[k]
        llm.reset_stats()
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        decode_s = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
        res[k].append(sum(len(o.token_ids) - 1 for o in outs) / decode_s)
        llm.wait_settled(10)
        print(f"rep {rep} k {k}: {res[k][-1]:.1f} tok/s accept len {llm.stats().get('spec_decode_mean_acceptance_length')} "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
base = statistics.median(res[0]) if 0 in res else None
for k in ks:
    m = statistics.median(res[k])
    print(f"k {k}: median {m:.1f} tok/s" + (f"  ratio to plain {m / base:.3f}" if base else "")
          + f"  runs {[round(x, 1) for x in res[k]]}")
for llm in engines.values():
    llm.close()
