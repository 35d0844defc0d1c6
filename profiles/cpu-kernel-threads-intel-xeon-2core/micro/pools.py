"""The bare one-row decode step (SmolLM2-135M, bfloat16, 2 kernel threads) in three thread layouts.

    python profiles/cpu-kernel-threads-intel-xeon-2core/micro/pools.py     # from the checkout's root

Each layout runs in a fresh interpreter (a process's OpenMP pools cannot be undone):
  one-thread   the model is loaded and every step runs on one thread (what the bare benchmarks measure)
  two-pools    loaded on the main thread with 2 kernel threads, steps on another thread (the engine before)
  one-pool     loaded on the main thread with 1 kernel thread, steps on another that claims 2 (the engine now)
"""

import json
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def layout(name: str) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from harness.decode_step import DecodeStepBench

    torch.set_num_threads(1 if name == "one-pool" else 2)
    result = {}

    def steps(bench):
        if name == "one-pool":
            torch.set_num_threads(2)
        t = bench.time_steps(1, repeats=9, warmup=2)
        result.update(ms=round(t.median_ms, 1), cpu_ms=round(t.cpu_median_ms, 1))

    if name == "one-thread":
        steps(DecodeStepBench(None, "bfloat16", None, max_rows=2, context=128))
    else:
        bench = DecodeStepBench(None, "bfloat16", None, max_rows=2, context=128)
        worker = threading.Thread(target=steps, args=(bench,))
        worker.start()
        worker.join()
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(layout(sys.argv[1])))
    else:
        for name in ("one-thread", "two-pools", "one-pool"):
            for _ in range(2):
                out = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, check=True,
                                     env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                          **{k: v for k, v in __import__("os").environ.items()
                                             if k in ("HOME", "ASYNCBATCH_CACHE")}})
                print(name, out.stdout.strip().splitlines()[-1], flush=True)
