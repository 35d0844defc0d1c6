"""w8a8 (compile_decode 0/1) on the 4 grounded one-request prompts, 128 greedy tokens: ngram (k = 4) against plain,
the first token where they part, at THREADS torch threads.

    python profiles/speculative-amd-epyc-zen4-2core/session-2026-12-05-c/w8a8_equal.py THREADS 1   # repo root
"""
import sys

sys.path.insert(0, "scripts")
from harness.speculative_workloads import load_workload, prompt_ids

from asyncbatch import LLM, SamplingParams

threads, compiled = int(sys.argv[1]), sys.argv[2] == "1"
outs = {}
for spec in (None, {"method": "ngram"}):
    llm = LLM(None, device="cpu", dtype="float32", quantization="w8a8", compile_decode=compiled, speculative_config=spec,
              num_threads=threads, seed=0)
    ps = [prompt_ids(llm, it["messages"]) for it in load_workload("grounded")[:4]]
    outs[spec is not None] = [llm.generate([p], SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)[0].token_ids for p in ps]
    llm.close()
for i, (a, b) in enumerate(zip(outs[False], outs[True])):
    first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"threads {threads} compiled {compiled} prompt {i}: equal {a == b} first diff at {first} of {len(a)}/{len(b)}")
