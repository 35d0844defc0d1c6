"""The first admission burst of a fresh engine core, with and without the planner warm-up, in alternating pairs.

    python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-d/first_burst_pairs.py [PAIRS]

Each run: a fresh ``LLM`` (sim, 1 ms steps, core process, overlap), four warm-up requests as
``scripts/bench_admission.py``'s burst case has, then 256 requests at once (32-token prompts, 400 outputs),
then one more such burst; prints the planner CPU per admitted request of each burst (``stats()``, the
figure of issue 25) and each admitting step's (admitted, CPU us). ``planner_warmup`` alternates True / False.
"""
import statistics
import sys

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams


def run(warm: bool, seed: int) -> tuple[float, float, list]:
    sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
    rng = np.random.default_rng(seed)
    figures, steps = [], []
    with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0, planner_warmup=warm) as llm:
        llm.generate([rng.integers(256, 30000, 32).tolist() for _ in range(4)],
                     SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.wait_settled(5.0)
        for _ in range(2):
            llm.reset_stats()
            prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
            llm.generate(prompts, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), use_tqdm=False)
            llm.wait_settled(5.0)
            figures.append(llm.stats()["admission_cpu_us_per_request"])
            steps.append([(r.num_admitted, round(r.admit_cpu_ms * 1e3)) for r in llm.timeline.window()
                          if r.num_admitted])
    return figures[0], figures[1], steps


pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
for i in range(pairs):
    for warm in (True, False) if i % 2 == 0 else (False, True):
        first, second, steps = run(warm, i)
        results[warm].append((first, second))
        print(f"pair {i} warmup={warm!s:5}: first burst {first:.2f} us/request, second {second:.2f}; "
              f"first burst's steps {steps[0]}", flush=True)
for warm in (True, False):
    firsts, seconds = [r[0] for r in results[warm]], [r[1] for r in results[warm]]
    print(f"planner_warmup={warm}: first burst median {statistics.median(firsts):.2f} "
          f"(min {min(firsts):.2f}, max {max(firsts):.2f}); second burst median {statistics.median(seconds):.2f}")
