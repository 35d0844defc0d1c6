"""Where the eager one-row float32 decode step of SmolLM2-135M goes on this CPU, measured without the profiler.

    python eager_step_parts.py [--threads 2] [--steps 15]

1. the memory floor: weight bytes / the best read bandwidth of a sum over 512 MiB (scripts/bench_lean_step.py's);
2. the step (``harness.decode_step``, the engine's loader and model): median of ``--steps``;
3. the same steps with wall-clock timers around each part (the timers' own cost is in "other"): the linears
   (oneDNN's packed products, LM head included), the RMS norms, paged attention (KV write, gathers, SDPA), the
   rotary, SiLU; "other" is the rest (residual adds, views, splits, the SiLU product, embedding, sampling,
   Python);
4. ``torch.rms_norm`` in place: the first call after a linear, the same norm again at once, and an add;
5. one row through each decoder weight shape, 30 distinct weights per shape (so they stream from memory as in
   a step): oneDNN's packed product, MKL (``F.linear``) and ``torch.mv``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from harness.decode_step import DecodeStepBench

import asyncbatch.model.packed_linears as packed
from asyncbatch.model import llama
from asyncbatch.model.quantization import weight_bytes


def read_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    t = torch.ones(mib * 2**20 // 4)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        t.sum()
        best = max(best, t.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def timed(acc: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - start
    return wrapper


def median_step(bench: DecodeStepBench, steps: int, acc: dict | None = None) -> tuple[float, dict]:
    rows = []
    for _ in range(steps):
        if acc is not None:
            acc.clear()
        start = time.perf_counter()
        bench.step(1)
        rows.append(((time.perf_counter() - start) * 1e3, {k: v * 1e3 for k, v in (acc or {}).items()}))
    rows.sort(key=lambda r: r[0])
    return rows[len(rows) // 2]


def linear_shapes(threads: int, rounds: int = 6) -> dict:
    shapes = {"q/k/v (960 x 576)": (960, 576), "o (576 x 576)": (576, 576), "gate/up (3072 x 576)": (3072, 576),
              "down (576 x 1536)": (576, 1536)}
    out = {}
    with torch.inference_mode():
        for name, (o, i) in shapes.items():
            weights = [torch.randn(o, i) for _ in range(30)]
            packs = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
            x = torch.randn(1, i)
            runs = {"onednn": [], "mkl": [], "mv": []}
            for _ in range(rounds):
                for kind, times in runs.items():
                    start = time.perf_counter()
                    for w, p in zip(weights, packs):
                        if kind == "onednn":
                            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                        elif kind == "mkl":
                            F.linear(x, w)
                        else:
                            torch.mv(w, x[0])
                    times.append((time.perf_counter() - start) * 1e3)
            out[name] = {k: statistics.median(v[1:]) for k, v in runs.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bench = DecodeStepBench(dtype="float32", max_rows=1, context=128, threads=args.threads)
    for _ in range(5):
        bench.step(1)
    bandwidth = read_bandwidth_gb_s()
    floor_ms = weight_bytes(bench.model) / (bandwidth * 1e9) * 1e3
    plain_ms, _ = median_step(bench, args.steps)
    print(f"threads {args.threads}; read bandwidth {bandwidth:.1f} GB/s; "
          f"weights {weight_bytes(bench.model) / 1e6:.0f} MB; memory floor {floor_ms:.1f} ms")
    print(f"one-row step (no timers): median {plain_ms:.1f} ms = {plain_ms / floor_ms:.2f}x the floor")

    acc: dict = {}
    packed._packed_product = timed(acc, "linears", packed._packed_product)
    norm_forward = llama.RMSNorm.forward
    llama.RMSNorm.forward = timed(acc, "norms", norm_forward)
    llama.paged_attention = timed(acc, "attention", llama.paged_attention)
    llama.rotate = timed(acc, "rotary", llama.rotate)
    llama.F.silu = timed(acc, "silu", F.silu)
    total, parts = median_step(bench, args.steps, acc)
    other = total - sum(parts.values())
    print(f"with timers: step {total:.1f} ms; " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
          + f", other {other:.1f}")
    print(f"  per call: linears {parts['linears'] * 1e3 / 121:.0f} us (121), norms {parts['norms'] * 1e3 / 61:.0f} us"
          f" (61), attention {parts['attention'] * 1e3 / 30:.0f} us (30 layers)")
    llama.RMSNorm.forward = norm_forward

    probe = {"first": 0.0, "again": 0.0, "add": 0.0}

    def norm_twice(self, x):
        a = time.perf_counter()
        y = norm_forward(self, x)
        b = time.perf_counter()
        norm_forward(self, x)
        c = time.perf_counter()
        x + x
        d = time.perf_counter()
        probe["first"] += b - a
        probe["again"] += c - b
        probe["add"] += d - c
        return y

    llama.RMSNorm.forward = norm_twice
    samples = []
    for _ in range(args.steps):
        probe.update(first=0.0, again=0.0, add=0.0)
        bench.step(1)
        samples.append(tuple(v * 1e6 / 61 for v in probe.values()))
    samples.sort()
    first, again, add = samples[len(samples) // 2]
    llama.RMSNorm.forward = norm_forward
    x, w = torch.randn(1, 576), torch.randn(576)
    with torch.inference_mode():
        for _ in range(200):
            torch.rms_norm(x, (576,), w, 1e-5)
        start = time.perf_counter()
        for _ in range(2000):
            torch.rms_norm(x, (576,), w, 1e-5)
        warm = (time.perf_counter() - start) / 2000 * 1e6
    print(f"torch.rms_norm of one 576-wide row, us a call: in the step {first:.0f} (right after a linear), the same"
          f" norm again at once {again:.0f}, in a loop of its own {warm:.0f}; an add in the step {add:.1f}")

    for name, r in linear_shapes(args.threads).items():
        print(f"30 x {name}, one row, ms: oneDNN packed {r['onednn']:.2f}, MKL F.linear {r['mkl']:.2f},"
              f" torch.mv {r['mv']:.2f}")


if __name__ == "__main__":
    main()
