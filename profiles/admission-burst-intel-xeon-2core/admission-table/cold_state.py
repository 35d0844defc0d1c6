"""What a step's array operations cost after the cache state a planner meets: warm (the same work just before),
after ``gc.collect()`` over a 300k-object heap (what ``scripts/bench_admission.py``'s planner case does before each
timed step), after a 1 ms / 0.2 ms sleep, and after streaming 8 MB through the caches. Medians of 15."""
import gc, time, numpy as np, statistics
junk = [{"a": i, "b": [i]*3} for i in range(300000)]  # a heap like the engine's
a = np.arange(64, dtype=np.int64); b = np.ones(64, dtype=np.int64); big = np.zeros((1024, 64), dtype=np.int64)
def ops():
    x = a + b; y = np.cumsum(a); z = a[b]; w = np.repeat(a, b); s = int(a.sum()); m = int(a.max())
    big[a] = 1; q = a * 3; r = a > 5; t = r.any(); u = np.concatenate([a, b]); v = np.arange(100)
    return x
def py():
    d = {}
    for i in range(64):
        d[i] = (i, i+1, i+2, i*3)
    return d
for name, f in (("numpy 13 ops", ops), ("python 64-loop", py)):
    for mode in ("warm", "cold"):
        xs = []
        for _ in range(15):
            if mode == "cold": gc.collect()
            else: f()
            t = time.perf_counter_ns(); f(); xs.append(time.perf_counter_ns() - t)
        print(name, mode, statistics.median(xs)/1e3, "us")
import threading
ev = threading.Event()
buf = np.zeros(8 * 2**20 // 8)
for name, f in (("numpy 13 ops", ops), ("python 64-loop", py)):
    for mode in ("sleep1ms", "touch8MB", "sleep0.2ms"):
        xs = []
        for _ in range(15):
            f()
            if mode == "sleep1ms": ev.wait(0.001)
            elif mode == "sleep0.2ms": ev.wait(0.0002)
            else: buf += 1
            t = time.perf_counter_ns(); f(); xs.append(time.perf_counter_ns() - t)
        print(name, mode, statistics.median(xs)/1e3, "us")
