"""Where bfloat16 greedy outputs part from float32's, with and without the float16-weight kernel: the eight
one-request prompts of ``bench_one_request.py`` (four grounded, four open chat), 128 greedy tokens each, through a
float32 engine and two bfloat16 engines (``ASYNCBATCH_BF16_FP16_KERNEL=0`` / ``=1``). Prints, per prompt, the index
of the first token that differs from float32's (128: none), and the same between the two bfloat16 engines.

    PYTHONPATH=$PWD:$PWD/scripts python profiles/fp16-weight-kernel-amd-epyc-zen4-2core/divergence.py
"""
import os
import statistics

from harness.speculative_workloads import WORKLOADS, load_workload, prompt_ids, spread

from asyncbatch import LLM, SamplingParams
from asyncbatch.model.fp16_kernel import FP16_KERNEL_ENV


def build(dtype: str, kernel: str | None) -> LLM:
    if kernel is not None:
        os.environ[FP16_KERNEL_ENV] = kernel
    try:
        return LLM(None, device="cpu", dtype=dtype, num_threads=2, seed=0)
    finally:
        os.environ.pop(FP16_KERNEL_ENV, None)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


engines = {"float32": build("float32", None), "bf16 oneDNN": build("bfloat16", "0"),
           "bf16 fp16 kernel": build("bfloat16", "1")}
first = engines["float32"]
prompts = [p for w in WORKLOADS for p in spread([prompt_ids(first, d["messages"]) for d in load_workload(w)], 4)]
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
tokens = {name: [list(llm.generate([p], params, use_tqdm=False)[0].token_ids) for p in prompts]
          for name, llm in engines.items()}
for llm in engines.values():
    llm.close()
rows = {
    "bf16 oneDNN vs float32": [first_difference(a, b) for a, b in zip(tokens["bf16 oneDNN"], tokens["float32"])],
    "bf16 fp16 kernel vs float32": [first_difference(a, b)
                                    for a, b in zip(tokens["bf16 fp16 kernel"], tokens["float32"])],
    "bf16 fp16 kernel vs bf16 oneDNN": [first_difference(a, b)
                                        for a, b in zip(tokens["bf16 fp16 kernel"], tokens["bf16 oneDNN"])],
}
print("first differing token of 128 (128: none), per prompt (4 grounded, 4 open chat), and the median")
for name, values in rows.items():
    print(f"{name:32s} {' '.join(f'{v:3d}' for v in values)}   median {statistics.median(values):.0f}")
