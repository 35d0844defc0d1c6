"""Per step kind (gap_report.step_kind), medians of the planner's chain around each step on sim at 1 ms:
python chain_by_step_kind.py spec|plain var|fixed (var: 100-400-token outputs; fixed: 400), two rounds."""
import sys, statistics
import numpy as np
from asyncbatch import LLM, SamplingParams, SimConfig
from asyncbatch.profiling.gap_report import step_kind
spec = sys.argv[1] == "spec"
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
kw = dict(speculative_config={"disable_by_batch_size": None}) if spec else {}
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0, **kw) as llm:
    rng = np.random.default_rng(0)
    for rnd in range(2):
        prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.wait_settled(5.0); llm.reset_stats()
        lens = [int(x) for x in rng.integers(100, 401, 256)] if sys.argv[2] == "var" else [400] * 256
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens], use_tqdm=False)
        llm.wait_settled(5.0)
        recs = sorted(llm.timeline.window(), key=lambda r: r.step_id)
        def us(a, b): return (b - a) * 1e6 if a and b > a else 0
        by = {}
        for prev, r in zip(recs, recs[1:]):
            k = step_kind(r, prev)
            # the chain that must fit in a step: result link of prev, apply prev, plan r
            by.setdefault(k, []).append(dict(sched=us(r.plan_start, r.schedule_end), write=us(r.fence_end, r.plan_end), launch=us(r.plan_end, r.launch_end),
                    apply_prev=us(prev.wait_end, prev.apply_end), reconcile_prev=prev.reconcile_ms * 1e3, settle=r.settle_ms * 1e3,
                    link_prev=us(prev.device_end, prev.wait_end) if prev.wait_end > prev.device_end else 0, drained=r.num_running))
        for k, v in by.items():
            print(sys.argv[1], sys.argv[2], rnd, k, len(v), {f: round(statistics.median(x[f] for x in v)) for f in v[0] if f != "drained"})
