"""The same admission (64 requests into an idle scheduler, the bench's planner rig) after different waits:
thread CPU microseconds of schedule + write, median of 6 fresh rigs per wait. A 1 ms sleep (as the planner
sleeps through a step) against 0.5 s asleep, 0.5 s spinning in Python, and 50 ms summing a 64 MiB array.
    python same_work_after_waits.py; taskset -c 0 python same_work_after_waits.py"""
import sys, gc, time, statistics
import numpy as np
sys.path.insert(0, "scripts")
from bench_admission import planner_rig
burst = 64
junk = np.ones(64 << 20, dtype=np.uint8)
def spin(t):
    end = time.perf_counter() + t
    while time.perf_counter() < end: pass
def trash(t):
    end = time.perf_counter() + t
    while time.perf_counter() < end: junk.sum()
for name, wait in (("sleep1ms", lambda: time.sleep(0.001)), ("spin0.5", lambda: spin(0.5)), ("sleep0.5", lambda: time.sleep(0.5)), ("trash0.05", lambda: trash(0.05)), ("sleep1ms", lambda: time.sleep(0.001))):
    res = []
    for seed in range(6):
        rig = planner_rig(burst, 0, seed)
        s, w, st = rig.scheduler, rig.writer, rig.staging
        for r in rig.burst: s.add(r)
        gc.freeze()
        wait()
        c0 = time.thread_time_ns()
        plan = s.schedule(); meta = w.write(plan, st.next_buffer())
        res.append((time.thread_time_ns() - c0) / 1e3)
        gc.unfreeze()
    print(name, "cpu us", statistics.median(res))
