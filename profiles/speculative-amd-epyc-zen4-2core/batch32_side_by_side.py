"""32 open-chat requests at once (64 tokens each), int4 weights and bfloat16 activations, 2 threads: the plain engine
against the ngram engine (num_speculative_tokens 3; disable_by_batch_size 8 switches its drafts off at 32 rows), three
alternating pairs in one process; output tok/s and device ms per step of each run, then the medians.

    PYTHONPATH=$PWD:$PWD/scripts python profiles/speculative-amd-epyc-zen4-2core/batch32_side_by_side.py
"""

import statistics
import time

from harness.speculative_workloads import cycle, load_workload, prompt_ids

from asyncbatch import LLM, SamplingParams


def main() -> None:
    common = {"device": "cpu", "dtype": "bfloat16", "num_threads": 2, "seed": 0, "quantization": "int4"}
    engines = {"plain": LLM(**common),
               "ngram": LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 3})}
    prompts = cycle([prompt_ids(engines["plain"], item["messages"]) for item in load_workload("open")], 32)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in engines}
    for rep in range(3):
        for name in ("plain", "ngram") if rep % 2 == 0 else ("ngram", "plain"):
            llm = engines[name]
            llm.reset_stats()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            llm.wait_settled(30.0)
            stats = llm.stats()
            runs[name].append((sum(len(o.token_ids) for o in outputs) / wall, stats["device_ms_per_step"],
                               stats["steps"]))
            print(rep, name, "tok/s %.1f device ms/step %.1f steps %d" % runs[name][-1], flush=True)
    for name, rows in runs.items():
        print(name, "median tok/s %.1f, device ms/step %.1f" % (statistics.median(r[0] for r in rows),
                                                                statistics.median(r[1] for r in rows)))
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
