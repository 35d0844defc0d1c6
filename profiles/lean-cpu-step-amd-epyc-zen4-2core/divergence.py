"""Where greedy outputs part from the float32 torch path's, with and without the lean CPU step: the eight
one-request prompts of ``bench_one_request.py`` (four grounded, four open chat), 128 greedy tokens each, through
four engines: float32 and bfloat16, each with ``ASYNCBATCH_CPU_LEAN_STEP=0`` (torch ops) and ``=1`` (the lean
step). Prints, per prompt, the index of the first token that differs (128: none) from the float32 torch engine's,
and the largest difference of the chosen tokens' logprobs where they agree.

    PYTHONPATH=$PWD:$PWD/scripts python profiles/lean-cpu-step-amd-epyc-zen4-2core/divergence.py
"""
import os
import statistics

from harness.speculative_workloads import WORKLOADS, load_workload, prompt_ids, spread

from asyncbatch import LLM, SamplingParams
from asyncbatch.model.lean_kernels import LEAN_STEP_ENV


def build(dtype: str, lean: str) -> LLM:
    os.environ[LEAN_STEP_ENV] = lean
    try:
        return LLM(None, device="cpu", dtype=dtype, num_threads=2, seed=0)
    finally:
        os.environ.pop(LEAN_STEP_ENV, None)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, logprobs=0)
results = {}
prompts = None
for name, dtype, lean in (("float32 torch", "float32", "0"), ("float32 lean", "float32", "1"),
                          ("bfloat16 torch", "bfloat16", "0"), ("bfloat16 lean", "bfloat16", "1")):
    llm = build(dtype, lean)
    if prompts is None:
        prompts = [p for w in WORKLOADS for p in spread([prompt_ids(llm, d["messages"]) for d in load_workload(w)], 4)]
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    results[name] = [(list(o.token_ids), list(o.logprobs.logprobs)) for o in outs]
    llm.close()
ref = results["float32 torch"]
print("first differing token of 128 against the float32 torch engine (128: none), per prompt (4 grounded, 4 open "
      "chat), the median; and the largest |logprob difference| of the chosen tokens before the first difference")
for name, rows in results.items():
    if name == "float32 torch":
        continue
    firsts = [first_difference(a[0], r[0]) for a, r in zip(rows, ref)]
    worst = max(max((abs(x - y) for x, y in zip(a[1][:f], r[1][:f])), default=0.0)
                for a, r, f in zip(rows, ref, firsts))
    print(f"{name:16s} {' '.join(f'{v:3d}' for v in firsts)}   median {statistics.median(firsts):5.1f}   "
          f"max |dlogprob| {worst:.2e}")
bt, bl = results["bfloat16 torch"], results["bfloat16 lean"]
firsts = [first_difference(a[0], b[0]) for a, b in zip(bl, bt)]
print(f"{'bf16 lean/torch':16s} {' '.join(f'{v:3d}' for v in firsts)}   median {statistics.median(firsts):5.1f}")
