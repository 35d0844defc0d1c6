"""How the lean step's time compares with the torch ops' as a step grows (rows) and its rows' contexts grow: the
evidence for ``lean_step.LEAN_MAX_ROWS`` and for dropping the context limit. The lean side's child raises the row
limit to 8 (``LEAN_LIMIT=N``: to N) and lifts any context limit for the measurement; each (side, context) runs in a child process of its
own, the sides alternating every round; each figure is the median over rounds of a child's median of 7 steps
(``harness.decode_step``: every row has ``context`` tokens, 2 torch threads).

    python profiles/lean-products-amd-epyc-zen4-2core/rows_sweep.py DTYPE CONTEXTS ROUNDS   (ROWS=1,2,... env)
    python profiles/lean-products-amd-epyc-zen4-2core/rows_sweep.py bfloat16 128,512,2048 2
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS = [int(r) for r in os.environ.get("ROWS", "1,2,3,4,5,8").split(",")]


def child(dtype: str, context: int) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    from asyncbatch.model import lean_step
    if os.environ["SIDE"] == "lean":
        lean_step.LEAN_MAX_ROWS = int(os.environ.get("LEAN_LIMIT", "8"))
    from harness.decode_step import DecodeStepBench

    bench = DecodeStepBench(dtype=dtype, threads=2, context=context, max_rows=max(ROWS))
    out = {}
    for rows in ROWS:
        bench.time_steps(rows, repeats=2, warmup=2)
        out[rows] = statistics.median(bench.time_steps(rows, repeats=7, warmup=1).samples_ms)
    return out


def main(dtype: str, contexts: list[int], rounds: int) -> None:
    for context in contexts:
        res: dict[str, list[dict]] = {"torch": [], "lean": []}
        for r in range(rounds):
            for side in ("torch", "lean") if r % 2 == 0 else ("lean", "torch"):
                env = {**os.environ, "SIDE": side, "ASYNCBATCH_CPU_LEAN_STEP": "0" if side == "torch" else "1"}
                text = subprocess.run([sys.executable, __file__, "child", dtype, str(context)], env=env,
                                      capture_output=True, text=True, check=True).stdout
                res[side].append(json.loads(text.strip().splitlines()[-1]))
        for rows in ROWS:
            a = statistics.median(x[str(rows)] for x in res["torch"])
            b = statistics.median(x[str(rows)] for x in res["lean"])
            print(f"{dtype} ctx {context:5d} rows {rows}: torch {a:6.2f} ms  lean {b:6.2f} ms  lean/torch {b / a:.3f}",
                  flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]))))
    else:
        main(sys.argv[1], [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3]))
