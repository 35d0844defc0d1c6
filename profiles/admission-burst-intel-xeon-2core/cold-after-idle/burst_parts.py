"""Where one admission step's planner time goes (the bench's planner rig with the engine's extras writer):
thread CPU of schedule (admit, of which _apply), write (write_prefill, extras build) and release_drained
(registering the admitted prompts' full blocks, after the launch in the engine); median of 9 rigs.
    python burst_parts.py BURST DECODING SLEEP_S     # e.g. 64 192 0.001"""
import sys, gc, time, statistics
sys.path.insert(0, "scripts")
from bench_admission import planner_rig
import asyncbatch.engine.admission as adm
import asyncbatch.engine.step_metadata as sm
from asyncbatch.engine.step_extras import StepExtrasWriter
from asyncbatch.engine.step_metadata import StepMetadataWriter
T = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.thread_time_ns(); r = f(*a, **k); T[key] = T.get(key, 0) + time.thread_time_ns() - t; return r
    setattr(obj, name, w)
wrap(adm.Admitter, "admit", "admit")
wrap(adm.Admitter, "_apply", "apply")
wrap(sm, "write_prefill", "write_prefill")
wrap(StepExtrasWriter, "build", "extras")
burst, decoding, sleep = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
res = []
for seed in range(9):
    rig = planner_rig(burst, decoding, seed)
    s, st = rig.scheduler, rig.staging
    w = StepMetadataWriter(s.rows, s.blocks, StepExtrasWriter(s.rows, 2, 49152 // 32))
    if decoding:
        plan = s.schedule(); meta = w.write(plan, st.next_buffer()); s.release_drained(plan); rig.apply(plan, meta)
    for r in rig.burst: s.add(r)
    gc.freeze(); T.clear()
    time.sleep(sleep)
    c0 = time.thread_time_ns()
    plan = s.schedule(); c1 = time.thread_time_ns()
    meta = w.write(plan, st.next_buffer()); c2 = time.thread_time_ns()
    s.release_drained(plan); c3 = time.thread_time_ns()
    gc.unfreeze()
    d = dict(T); d["schedule"] = c1 - c0; d["write"] = c2 - c1; d["release"] = c3 - c2; d["total"] = c3 - c0
    res.append(d)
for k in ["total", "schedule", "admit", "apply", "write", "write_prefill", "extras", "release"]:
    v = statistics.median(r.get(k, 0) / 1e3 for r in res)
    print(f"{k:14s} {v:8.1f} us  {v / burst:6.2f} per request")
