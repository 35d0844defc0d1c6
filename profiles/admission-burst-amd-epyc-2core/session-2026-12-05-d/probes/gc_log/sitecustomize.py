# PYTHONPATH=<this folder>: log every GC pass over 30 us in an engine thread (pid, thread, generation, us).
import gc
import os
import sys
import threading
import time

_t = {}
def _cb(phase, info):
    tid = threading.get_ident()
    if phase == "start":
        _t[tid] = time.perf_counter()
    else:
        d = (time.perf_counter() - _t.pop(tid, time.perf_counter())) * 1e6
        if d > 30 and threading.current_thread().name.startswith("asyncbatch"):
            sys.stderr.write(f"GC pid {os.getpid()} {threading.current_thread().name} gen{info['generation']} {d:.0f}us collected {info['collected']}\n")
gc.callbacks.append(_cb)
