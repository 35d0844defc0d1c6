"""Bursts through one engine (sim, 1 ms steps, engine process): per burst the admission figure of ``stats()``, each
admitting step's planner CPU per admitted request, and the planner thread's GC time inside the admitting steps and
inside all steps (``StepRecord.gc_ms``). 256 requests a burst, 32-token prompts, 400 greedy outputs, as
``scripts/bench_admission.py --cases burst``.

    python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-e/engine_bursts_gc.py [BURSTS]
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from asyncbatch import LLM, SamplingParams, SimConfig


def main(bursts: int) -> None:
    sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
    with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0) as llm:
        rng = np.random.default_rng(0)
        params = [SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, seed=i) for i in range(256)]
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        llm.generate([rng.integers(256, 30000, 32).tolist() for _ in range(4)], warm, use_tqdm=False)
        llm.wait_settled(5.0)
        for burst in range(bursts):
            prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
            llm.reset_stats()
            llm.generate(prompts, params, use_tqdm=False)
            llm.wait_settled(5.0)
            records = llm.timeline.window()
            admitting = [r for r in records if r.num_admitted]
            per_step = [round(r.admit_cpu_ms * 1e3 / r.num_admitted, 1) for r in admitting]
            print(f"burst {burst}: {llm.stats()['admission_cpu_us_per_request']:.2f} us a request, steps {per_step}; "
                  f"planner GC in the admitting steps {sum(r.gc_ms for r in admitting):.3f} ms, in all "
                  f"{sum(r.gc_ms for r in records):.3f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
