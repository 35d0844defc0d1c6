"""Per admission step of a live engine (sim 1 ms, in-process core, 256 x 32-token prompts at once, default token
budget): wall and thread CPU us of ``Scheduler.schedule``, ``StepMetadataWriter.write`` and ``EngineCore._release``,
and the plan's admission CPU; then ``stats()``'s admission figure. Three engines.

    PYTHONPATH=<tree> python admit_wall.py [spec]     # spec: ngram speculation on (k = 4)
"""
import sys
import time
from pathlib import Path

from asyncbatch.engine import core, step_metadata
from asyncbatch.engine import scheduler as sched_mod

rec = []
cur = {}

def wrap(cls, name, key):
    f = getattr(cls, name)
    def w(self, *a, **k):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        r = f(self, *a, **k)
        cur[key] = (cur.get(key, (0, 0))[0] + time.perf_counter_ns() - t0, cur.get(key, (0, 0))[1] + time.thread_time_ns() - c0)
        if key == "release":
            if cur.get("n"):
                rec.append(dict(cur))
            cur.clear()
        return r
    setattr(cls, name, w)

orig_schedule = sched_mod.Scheduler.schedule
def sched(self):
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    plan = orig_schedule(self)
    cur["schedule"] = (time.perf_counter_ns() - t0, time.thread_time_ns() - c0)
    cur["n"] = plan.num_admitted if plan is not None else 0
    cur["admit_cpu"] = plan.admit_cpu_s * 1e9 if plan is not None else 0
    return plan
sched_mod.Scheduler.schedule = sched
wrap(step_metadata.StepMetadataWriter, "write", "write")
wrap(core.EngineCore, "_release", "release")

# The shared workload (``cost-split/burst_workload.py``), as ``cost-split/in_engine_parts.py`` runs it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cost-split"))
from burst_workload import run_burst

spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None} if sys.argv[1:] == ["spec"] \
    else None
for run in range(3):
    st = run_burst(run, rec.clear, **({"speculative_config": spec} if spec else {}))
    for s in rec:
        n = s["n"]
        f = lambda k, s=s: f"{s[k][0] / 1e3:6.0f}/{s[k][1] / 1e3:4.0f}"
        print(f"run {run} n {n:3} schedule {f('schedule')} write {f('write')} release {f('release')} us wall/cpu; admit_cpu+wp {s['admit_cpu']/1e3:5.0f}")
    print("stats admission_cpu_us_per_request", round(st.get("admission_cpu_us_per_request", -1), 2), "busy", round(st.get("device_busy_fraction", -1), 4))
