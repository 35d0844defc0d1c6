"""What a step's array operations cost after the cache state a planner meets: warm (the same work just before),
after ``gc.collect()`` over a 300k-object heap (what ``scripts/bench_admission.py``'s planner case does before each
timed step), after a 1 ms / 0.2 ms sleep, and after streaming 8 MB through the caches. Medians of 15.

    python cold_state.py
"""

import gc
import statistics
import threading
import time

import numpy as np

heap = [{"a": i, "b": [i] * 3} for i in range(300_000)]  # a heap of the engine's order of size
a, b = np.arange(64, dtype=np.int64), np.ones(64, dtype=np.int64)
table = np.zeros((1024, 64), dtype=np.int64)
stream = np.zeros(8 * 2**20 // 8)
event = threading.Event()


def numpy_ops() -> tuple:
    """13 calls on 64-element arrays, of the kinds an admission step makes."""
    table[a] = 1
    return (a + b, np.cumsum(a), a[b], np.repeat(a, b), int(a.sum()), int(a.max()), a * 3, (a > 5).any(),
            np.concatenate([a, b]), np.arange(100))


def python_loop() -> dict:
    """A 64-iteration Python loop building tuples, like the admission pass."""
    return {i: (i, i + 1, i + 2, i * 3) for i in range(64)}


STATES = {
    "warm": lambda f: f(),
    "after gc.collect()": lambda f: gc.collect(),
    "after a 1 ms sleep": lambda f: (f(), event.wait(0.001)),
    "after a 0.2 ms sleep": lambda f: (f(), event.wait(0.0002)),
    "after 8 MB streamed": lambda f: (f(), stream.__iadd__(1)),
}

for name, work in (("numpy 13 ops", numpy_ops), ("python 64-loop", python_loop)):
    for state, before in STATES.items():
        times = []
        for _ in range(15):
            before(work)
            t = time.perf_counter_ns()
            work()
            times.append(time.perf_counter_ns() - t)
        print(f"{name:15} {state:22} {statistics.median(times) / 1e3:8.1f} us")
