"""One request at a time (the 4 grounded prompts, 128 greedy tokens), one engine in this process: each pure decode
step's device time by (draft tokens it verified, tokens it emitted), and the idle time between steps.

    python profiles/speculative-amd-epyc-zen4-2core/session-2026-12-05-c/steps_by_width.py w8a8 1 K   # from the repo root
    (quantization, compile_decode 0/1, num_speculative_tokens K; 0: no speculation)
"""
import statistics
import sys

sys.path.insert(0, "scripts")
from harness.speculative_workloads import load_workload, prompt_ids

from asyncbatch import LLM, SamplingParams

quant, compiled, k = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
dtype = "float32" if quant == "w8a8" else "bfloat16"
spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
llm = LLM(None, device="cpu", dtype=dtype, quantization=None if quant == "none" else quant, compile_decode=compiled,
          speculative_config=spec, num_threads=2, seed=0, engine_process=False)
prompts = [prompt_ids(llm, it["messages"]) for it in load_workload("grounded")[:4]]
llm.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
llm.reset_stats()
for p in prompts:
    llm.generate([p], SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)
llm.wait_settled(10)
records = llm.timeline.window()
by: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
for r in records:
    if r.num_prefill == 0 and r.device_end > r.device_start:
        by.setdefault((r.spec_draft_tokens, r.output_tokens), []).append(
            ((r.device_end - r.device_start) * 1e3, r.forward_ms, r.sample_ms))
for key, v in sorted(by.items()):
    print(f"drafts,emitted {key}: n {len(v)}  device {statistics.median(x[0] for x in v):.1f} ms  "
          f"forward {statistics.median(x[1] for x in v):.1f}  sample {statistics.median(x[2] for x in v):.2f}")
print("", llm.stats().get("spec_decode_mean_acceptance_length"))
idle = sorted((b.device_start - a.device_end) * 1e3 for a, b in zip(records, records[1:])
              if a.num_prefill == 0 and b.num_prefill == 0)
print(f"idle between steps: median {statistics.median(idle):.2f} ms  p90 {idle[int(len(idle) * .9)]:.2f}")
llm.close()
