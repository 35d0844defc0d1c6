"""The one-row (and two-, three-row) bfloat16 decode step of the default model with and without fbgemm's
float16-weight kernel (``model/fp16_kernel.py``), side by side: each round runs one child process per side
(``ASYNCBATCH_BF16_FP16_KERNEL=0`` / ``=1``, the order flipped every round), each timing ``harness.decode_step``'s
real step (context 128, 2 torch threads) after warm-up, and the floor measured in the same child: the bytes the
step reads in full over the best of five ``sum()`` passes. Also checks that both sides pick the same greedy token.

    python profiles/fp16-weight-kernel-amd-epyc-zen4-2core/ab_step.py 6 1,2,3
"""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(rows_list: list[int]) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    import torch
    from harness.decode_step import DecodeStepBench

    from asyncbatch.model.packed_linears import PackedLinear

    bench = DecodeStepBench(dtype="bfloat16", threads=2)
    held = sum(isinstance(m, PackedLinear) and m.fp16 is not None for m in bench.model.modules())
    ones = torch.ones(512 * 2**20 // 4)
    passes = []
    for _ in range(5):
        t0 = time.perf_counter()
        ones.sum()
        passes.append(time.perf_counter() - t0)
    floor_ms = bench.weight_bytes() / (ones.nbytes / min(passes)) * 1e3
    out = {"fp16_linears": held, "floor_ms": floor_ms, "tokens": {}, "ms": {}}
    for rows in rows_list:
        out["tokens"][rows] = bench.step(rows).tolist()
        out["ms"][rows] = bench.time_steps(rows, repeats=9, warmup=3).median_ms
    return out


def main(rounds: int, rows_list: list[int]) -> None:
    results: dict[str, list[dict]] = {"0": [], "1": []}
    for r in range(rounds):
        for side in ("0", "1") if r % 2 == 0 else ("1", "0"):
            env = {**os.environ, "ASYNCBATCH_BF16_FP16_KERNEL": side, "PYTHONPATH": str(ROOT)}
            text = subprocess.run([sys.executable, __file__, "child", ",".join(map(str, rows_list))], env=env,
                                  capture_output=True, text=True, check=True).stdout
            results[side].append(json.loads(text.strip().splitlines()[-1]))
    print(f"bfloat16 decode step, context 128, 2 torch threads; {rounds} rounds, each side a child process a round, "
          "median of 9 steps each")
    print(f"float16 copies held: without {results['0'][0]['fp16_linears']}, with {results['1'][0]['fp16_linears']} "
          "decoder linears")
    for rows in rows_list:
        key = str(rows)
        a = [x["ms"][key] for x in results["0"]]
        b = [x["ms"][key] for x in results["1"]]
        fa = [x["ms"][key] / x["floor_ms"] for x in results["0"]]
        fb = [x["ms"][key] / x["floor_ms"] for x in results["1"]]
        same = all(x["tokens"][key] == y["tokens"][key] for x, y in zip(results["0"], results["1"]))
        print(f"rows {rows}: oneDNN {statistics.median(a):6.2f} ms ({statistics.median(fa):.2f}x floor) | "
              f"float16 kernel {statistics.median(b):6.2f} ms ({statistics.median(fb):.2f}x floor) | "
              f"with / without {statistics.median(b) / statistics.median(a):.3f} | same tokens {same}")
        print(f"    rounds without: {' '.join(f'{v:.1f}' for v in a)}")
        print(f"    rounds with:    {' '.join(f'{v:.1f}' for v in b)}")
    floors = [x["floor_ms"] for side in results.values() for x in side]
    print(f"floor ms (each child): median {statistics.median(floors):.2f}, {min(floors):.2f}-{max(floors):.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(json.dumps(child([int(r) for r in sys.argv[2].split(",")])))
    else:
        main(int(sys.argv[1]), [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1").split(",")])
