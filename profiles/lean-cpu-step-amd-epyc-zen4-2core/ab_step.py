"""The default model's decode step with the lean CPU step and with torch's ops, side by side: each round runs
one child process per side (``ASYNCBATCH_CPU_LEAN_STEP=0`` / ``=1``, the order flipped every round), each timing
``harness.decode_step``'s real step (2 torch threads) after warm-up, and the floor measured in the same child
between the step timings: the bytes the step's weights take over the best of three ``sum()`` passes (``x floor``:
the median of seven step / floor pairs; the VM's read rate moves by a third from minute to minute). Also checks both sides pick the same greedy
tokens (float32; bfloat16's may differ at a near-tie).

    python profiles/lean-cpu-step-amd-epyc-zen4-2core/ab_step.py ROUNDS DTYPE ROWS [CONTEXT]
    python profiles/lean-cpu-step-amd-epyc-zen4-2core/ab_step.py 6 bfloat16 1,2 128
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(dtype: str, rows_list: list[int], context: int) -> dict:
    """Per row count: seven (floor, median of five steps) pairs and their medians
    (``harness.decode_step.steps_against_floor``), and whether the lean kernels built."""
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    from harness.decode_step import DecodeStepBench, steps_against_floor

    bench = DecodeStepBench(dtype=dtype, threads=2, context=context, max_rows=max(rows_list))
    return {"lean": bench.model.lean_kernels is not None, **steps_against_floor(bench, rows_list)}


def main(rounds: int, dtype: str, rows_list: list[int], context: int) -> None:
    results: dict[str, list[dict]] = {"0": [], "1": []}
    for r in range(rounds):
        for side in ("0", "1") if r % 2 == 0 else ("1", "0"):
            env = {**os.environ, "ASYNCBATCH_CPU_LEAN_STEP": side, "PYTHONPATH": str(ROOT)}
            text = subprocess.run([sys.executable, __file__, "child", dtype, ",".join(map(str, rows_list)),
                                   str(context)], env=env, capture_output=True, text=True, check=True).stdout
            results[side].append(json.loads(text.strip().splitlines()[-1]))
    print(f"{dtype} decode step, context {context}, 2 torch threads; {rounds} rounds, each side a child process a "
          f"round, seven (floor, median of 5 steps) pairs each; lean kernels built: with {results['1'][0]['lean']}, "
          f"without {results['0'][0]['lean']}")
    for rows in rows_list:
        key = str(rows)
        a = [x["ms"][key] for x in results["0"]]
        b = [x["ms"][key] for x in results["1"]]
        fa = [x["ratio"][key] for x in results["0"]]
        fb = [x["ratio"][key] for x in results["1"]]
        floors = [x["floor_ms"][key] for side in results.values() for x in side]
        same = all(x["tokens"][key] == y["tokens"][key] for x, y in zip(results["0"], results["1"]))
        print(f"rows {rows}: torch ops {statistics.median(a):6.2f} ms ({statistics.median(fa):.2f}x floor) | "
              f"lean {statistics.median(b):6.2f} ms ({statistics.median(fb):.2f}x floor) | "
              f"lean / torch {statistics.median(b) / statistics.median(a):.3f} | same tokens {same}")
        print(f"    rounds torch: {' '.join(f'{v:.1f}' for v in a)}   x floor: {' '.join(f'{v:.2f}' for v in fa)}")
        print(f"    rounds lean:  {' '.join(f'{v:.1f}' for v in b)}   x floor: {' '.join(f'{v:.2f}' for v in fb)}")
        print(f"    floor ms (each child's median): {statistics.median(floors):.2f}, {min(floors):.2f}-{max(floors):.2f}")

if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], [int(r) for r in sys.argv[3].split(",")], int(sys.argv[4]))))
    else:
        main(int(sys.argv[1]), sys.argv[2], [int(r) for r in sys.argv[3].split(",")],
             int(sys.argv[4]) if len(sys.argv) > 4 else 128)
