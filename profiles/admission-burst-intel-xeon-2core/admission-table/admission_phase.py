"""In-engine admission phase: 256 requests at once at 1 ms sim steps (token ids only, 40-token outputs), per round:
admission us per request (the figure ``stats()`` reports) and the idle ms of the admission phase (the gaps up to
the step after the last one that admits). Run as (trees interleaved, a fresh process each):

    for i in 1 2 3; do for t in /tmp/wt-base /work/main; do
        echo "$t $(PYTHONPATH=$t python admission_phase.py 256 8 | tail -1)"; done; done
"""
import statistics
import sys

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.profiling.gap_report import gap_report
from asyncbatch.sampling_params import SamplingParams

n, rounds = int(sys.argv[1]), int(sys.argv[2])
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=n, seed=0, skip_tokenizer_init=True) as llm:
    rng = np.random.default_rng(0)
    adm, idle = [], []
    for r in range(rounds):
        prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(n)]
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.wait_settled(5.0); llm.reset_stats()
        params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, seed=i) for i in range(n)]
        llm.generate(prompts, params, use_tqdm=False)
        llm.wait_settled(5.0)
        recs = sorted(llm.timeline.window(), key=lambda x: x.step_id)
        admitting = [x for x in recs if x.num_admitted]
        last = max(x.step_id for x in admitting)
        rep = gap_report(llm)
        phase = sum(g.gap_ms for g in rep.gaps if g.step_after <= last + 1)
        a = sum(x.admit_ms for x in admitting) * 1e3 / sum(x.num_admitted for x in admitting)
        adm.append(a); idle.append(phase)
    print(f"admission_us {statistics.median(adm):.2f} [{' '.join(f'{v:.1f}' for v in adm)}]  "
          f"phase_idle_ms {statistics.median(idle):.2f} [{' '.join(f'{v:.2f}' for v in idle)}]")
