"""The default model's decode step with the torch ops, the lean step on each linear's own product, and the lean
step on ``lean_gemv.c``'s products, side by side: each round runs one child process per side (the environment
below; the order rotates every round), each timing ``harness.decode_step``'s real step (2 torch threads) after
warm-up, with the floor measured in the same child between the step timings: the bytes the step's weights take
over the best of three ``sum()`` passes (``x floor``: the median of seven step / floor pairs). Also checks the
sides' greedy tokens against the first side's (float32; bfloat16's may differ at a near-tie). The earlier
folder's ``ab_step.py`` with any number of sides.

    python profiles/lean-products-amd-epyc-zen4-2core/ab_step.py ROUNDS DTYPE ROWS [CONTEXT]
    python profiles/lean-products-amd-epyc-zen4-2core/ab_step.py 4 float32 1,2 128
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIDES = {"torch ops": {"ASYNCBATCH_CPU_LEAN_STEP": "0"},
         "lean, own products": {"ASYNCBATCH_CPU_LEAN_STEP": "1", "ASYNCBATCH_CPU_LEAN_PRODUCTS": "0"},
         "lean, lean_gemv": {"ASYNCBATCH_CPU_LEAN_STEP": "1", "ASYNCBATCH_CPU_LEAN_PRODUCTS": "1"}}


def child(dtype: str, rows_list: list[int], context: int) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    from harness.decode_step import DecodeStepBench, steps_against_floor

    bench = DecodeStepBench(dtype=dtype, threads=2, context=context, max_rows=max(rows_list))
    return {"weight_mb": bench.weight_bytes() / 1e6, **steps_against_floor(bench, rows_list)}


def main(rounds: int, dtype: str, rows_list: list[int], context: int) -> None:
    names = list(SIDES)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            env = {**os.environ, **SIDES[name], "PYTHONPATH": str(ROOT)}
            text = subprocess.run([sys.executable, __file__, "child", dtype, ",".join(map(str, rows_list)),
                                   str(context)], env=env, capture_output=True, text=True, check=True).stdout
            results[name].append(json.loads(text.strip().splitlines()[-1]))
    print(f"{dtype} decode step, context {context}, 2 torch threads; {rounds} rounds, each side a child process a "
          f"round, seven (floor, median of 5 steps) pairs each; weights read a step "
          f"{results[names[0]][0]['weight_mb']:.0f} MB")
    for rows in rows_list:
        key = str(rows)
        base = statistics.median(x["ms"][key] for x in results[names[0]])
        print(f"rows {rows}:")
        for name in names:
            ms = [x["ms"][key] for x in results[name]]
            ratio = [x["ratio"][key] for x in results[name]]
            same = all(x["tokens"][key] == y["tokens"][key] for x, y in zip(results[names[0]], results[name]))
            print(f"  {name:20s} {statistics.median(ms):6.2f} ms  {statistics.median(ratio):.2f}x floor  "
                  f"/ torch ops {statistics.median(ms) / base:.3f}  same tokens as torch ops {same}")
            print(f"      rounds ms: {' '.join(f'{v:.1f}' for v in ms)}   x floor: {' '.join(f'{v:.2f}' for v in ratio)}")
        floors = [x["floor_ms"][key] for side in results.values() for x in side]
        print(f"  floor ms (each child's median): {statistics.median(floors):.2f}, {min(floors):.2f}-{max(floors):.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], [int(r) for r in sys.argv[3].split(",")], int(sys.argv[4]))))
    else:
        main(int(sys.argv[1]), sys.argv[2], [int(r) for r in sys.argv[3].split(",")],
             int(sys.argv[4]) if len(sys.argv) > 4 else 128)
