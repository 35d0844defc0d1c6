"""32 open-chat requests at once (64 tokens each), w8a8 + compile_decode, 2 threads: the plain engine against the
ngram engine (num_speculative_tokens 6; disable_by_batch_size 8 switches its drafts off at 32 rows), six
alternating pairs in one process, each engine warmed up on one untimed batch; output tok/s and device ms per step
of each run, then the medians and the per-pair ratios.

    PYTHONPATH=$PWD:$PWD/scripts python profiles/speculative-amd-epyc-zen4-2core/w8a8-compiled-k6/batch32_pairs.py
"""

import statistics
import time

from harness.speculative_workloads import cycle, load_workload, prompt_ids

from asyncbatch import LLM, SamplingParams


def main() -> None:
    common = {"device": "cpu", "dtype": "float32", "num_threads": 2, "seed": 0, "quantization": "w8a8",
              "compile_decode": True}
    engines = {"plain": LLM(**common),
               "ngram": LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 6})}
    prompts = cycle([prompt_ids(engines["plain"], item["messages"]) for item in load_workload("open")], 32)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    for llm in engines.values():
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in engines}
    for rep in range(6):
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
    ratios = [n[0] / p[0] for p, n in zip(runs["plain"], runs["ngram"])]
    print("ngram / plain per pair:", " ".join(f"{r:.2f}" for r in ratios), "median %.2f" % statistics.median(ratios))
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
