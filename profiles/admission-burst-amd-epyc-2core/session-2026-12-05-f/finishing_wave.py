"""Run from the repository root: python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-f/finishing_wave.py before|after 12|40 [profile].
The finishing wave on the planner (Scheduler alone): 256 requests finishing in one step, overlap order
(plan N+1, write, release N+1's drained, then apply N). Reports the worst step's release CPU and apply CPU (us),
best of 9. argv: label max_tokens [profile]"""
import cProfile, pstats, gc, sys, time
import numpy as np
sys.path.insert(0, "scripts")
from bench_admission import _rig
from asyncbatch.engine.request import Request
from asyncbatch.sampling_params import SamplingParams
MAXT = int(sys.argv[2]); PROF = len(sys.argv) > 3
pr = cProfile.Profile()
def run(seed):
    rng = np.random.default_rng(seed)
    rig = _rig(256 * 40 + 1, 256)
    s = rig.scheduler
    for i in range(256):
        s.add(Request(str(i), i, rng.integers(256, 30000, 32).tolist(),
                      SamplingParams(max_tokens=MAXT, temperature=0.0, ignore_eos=True, seed=i), i, 0.0))
    pending, rel, app = None, 0.0, 0.0
    while s.has_work() or pending is not None:
        plan = None
        if s.has_work():
            plan = s.schedule(); meta = rig.writer.write(plan, rig.staging.next_buffer())
            gc.freeze(); c0 = time.thread_time_ns()
            if PROF and len(plan.drained) >= 64: pr.enable()
            s.release_drained(plan)
            pr.disable()
            c = time.thread_time_ns() - c0; gc.unfreeze()
            if len(plan.drained) >= 64: rel = max(rel, c / 1e3)
        if pending is not None:
            gc.freeze(); c0 = time.thread_time_ns()
            if PROF and pending[0].drained: pr.enable()
            out = s.apply(pending[0], rig.tokens[:pending[1].num_sampled], rig.finite[:pending[1].num_sampled])
            pr.disable()
            c = time.thread_time_ns() - c0; gc.unfreeze()
            if int((out.finish != 0).sum()) >= 64: app = max(app, c / 1e3)
        s.settle_released()
        pending = (plan, meta) if plan is not None else None
    return rel, app
runs = [run(k) for k in range(3 if PROF else 9)]
print(sys.argv[1], f"max_tokens={MAXT}: worst release CPU us {min(r[0] for r in runs):.1f}, worst finishing apply CPU us {min(r[1] for r in runs):.1f} (best of {len(runs)})")
if PROF: pstats.Stats(pr).sort_stats("tottime").print_stats(20)
