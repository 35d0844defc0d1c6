"""The evicting burst through a live engine (``sim``, 1 ms steps, engine core in its own process): 256 requests of
32-token prompts and 400 outputs fill a 7,000-block KV cache (27 blocks each: 6,912 cached once they end, 87 never
used); then 256 new prompts arrive at once, with 400-token outputs, which the cache holds without preempting: their
admission evicts ~425 cached blocks (their decode steps evict the rest they need later). ``stats()`` of the second
wave: admission cost per request (wall and planner CPU), whole-run device busy (the gap report), the blocks evicted
and the preemptions (none expected). Three runs.

    PYTHONPATH=<tree> python engine_evicting_burst.py
"""

import numpy as np

from asyncbatch import LLM, SamplingParams, SimConfig
from asyncbatch.profiling.gap_report import gap_report, lifetimes_of


def main() -> None:
    sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
    for run in range(3):
        with LLM(device="sim", sim=sim, max_num_seqs=256, num_kv_blocks=7000, seed=0,
                 skip_tokenizer_init=True) as llm:
            rng = np.random.default_rng(run)
            first = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
            llm.generate(first, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), use_tqdm=False)
            llm.wait_settled(5.0)
            before = llm.prefix_cache_stats()["evictions"]
            llm.reset_stats()
            second = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
            outputs = llm.generate(second, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                                   use_tqdm=False)
            llm.wait_settled(5.0)
            stats, report = llm.stats(), gap_report(llm, lifetimes_of(outputs))
            evicted = llm.prefix_cache_stats()["evictions"] - before
            preempted = stats["preemptions"]
        print(f"run {run}: admission {stats['admission_us_per_request']:6.2f} us a request wall, "
              f"{stats['admission_cpu_us_per_request']:6.2f} CPU; busy {report.busy_fraction:.4f}; "
              f"{evicted} blocks evicted, preemptions {preempted}")


if __name__ == "__main__":
    main()
