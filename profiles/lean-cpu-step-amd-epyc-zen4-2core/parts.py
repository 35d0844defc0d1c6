"""Where the lean CPU step's one-row time goes: the step timed plain, then with each product and each kernel call
timed (``time.perf_counter`` around it; ``rest`` is everything else: embedding, rotary rows, buffers, the final
norm, the LM head, greedy sampling, the Python between the calls). Run from the repository root:

    python profiles/lean-cpu-step-amd-epyc-zen4-2core/parts.py bfloat16
"""
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch
from harness.decode_step import DecodeStepBench

bench = DecodeStepBench(dtype=sys.argv[1], threads=2)
spent: dict[str, float] = collections.defaultdict(float)


def timed_product(product):
    def call(h):
        t0 = time.perf_counter()
        out = product(h)
        spent["products (decoder)"] += time.perf_counter() - t0
        return out
    return call


class TimedKernels:
    def __init__(self, lib) -> None:
        self.lib = lib

    def __getattr__(self, name: str):
        fn = getattr(self.lib, name)

        def call(*args) -> None:
            t0 = time.perf_counter()
            fn(*args)
            spent[name] += time.perf_counter() - t0
        return call


steps = 30
with torch.inference_mode():
    for _ in range(5):
        bench.step(1)
    t0 = time.perf_counter()
    for _ in range(steps):
        bench.step(1)
    plain = (time.perf_counter() - t0) / steps
    for layer in bench.model.lean_plan:  # the per-layer products the first lean step gathered (lean_step.layer_plan)
        for name in ("qkv", "o", "gate_up", "gate", "up", "down"):
            if getattr(layer, name) is not None:
                setattr(layer, name, timed_product(getattr(layer, name)))
    bench.model.lean_kernels = TimedKernels(bench.model.lean_kernels)
    t0 = time.perf_counter()
    for _ in range(steps):
        bench.step(1)
    timed = (time.perf_counter() - t0) / steps
parts = {name: s / steps * 1e3 for name, s in spent.items()}
print(f"{sys.argv[1]} one-row step {plain * 1e3:.2f} ms (instrumented {timed * 1e3:.2f}); ms a step: "
      + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + f", rest {timed * 1e3 - sum(parts.values()):.2f}")
