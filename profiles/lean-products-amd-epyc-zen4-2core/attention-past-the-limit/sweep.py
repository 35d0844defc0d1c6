"""Steps of more decode rows than the lean step takes (the model's ``lean_max_rows``: ten on this VM), with torch's
decode attention (``ASYNCBATCH_CPU_LEAN_STEP=0``: the pages gathered and SDPA, every layer) against the lean
step's kernel inside the torch ops (``lean_attention``, the default). Each (side, context) runs in a child process
of its own, the sides alternating every round; each figure is the median over rounds of a child's median of
``REPEATS`` steps (``harness.decode_step``: every row has ``context`` tokens, 2 torch threads), plus the greedy
tokens of both sides' first step.

    python sweep.py DTYPE CONTEXTS ROUNDS          (ROWS=12,16,32 REPEATS=5 env)
    python sweep.py float32 128,512,2048 2
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ROWS = [int(r) for r in os.environ.get("ROWS", "12,16,32").split(",")]
REPEATS = int(os.environ.get("REPEATS", "5"))


def child(dtype: str, context: int) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    from harness.decode_step import DecodeStepBench

    bench = DecodeStepBench(dtype=dtype, threads=2, context=context, max_rows=max(ROWS))
    assert max(ROWS) > 0 and min(ROWS) > bench.model.lean_max_rows, "every step past the lean step's limit"
    out = {}
    for rows in ROWS:
        tokens = bench.step(rows).tolist()
        bench.time_steps(rows, repeats=1, warmup=1)
        out[rows] = (statistics.median(bench.time_steps(rows, repeats=REPEATS, warmup=0).samples_ms), tokens)
    return out


def main(dtype: str, contexts: list[int], rounds: int) -> None:
    for context in contexts:
        res: dict[str, list[dict]] = {"torch": [], "kernel": []}
        for r in range(rounds):
            for side in ("torch", "kernel") if r % 2 == 0 else ("kernel", "torch"):
                env = {**os.environ, "ASYNCBATCH_CPU_LEAN_STEP": "0" if side == "torch" else "1"}
                text = subprocess.run([sys.executable, __file__, "child", dtype, str(context)], env=env,
                                      capture_output=True, text=True, check=True).stdout
                res[side].append(json.loads(text.strip().splitlines()[-1]))
        for rows in ROWS:
            a = statistics.median(x[str(rows)][0] for x in res["torch"])
            b = statistics.median(x[str(rows)][0] for x in res["kernel"])
            same = sum(x == y for x, y in zip(res["torch"][0][str(rows)][1], res["kernel"][0][str(rows)][1]))
            print(f"{dtype} ctx {context:5d} rows {rows:3d}: torch attention {a:8.2f} ms  kernel {b:8.2f} ms  "
                  f"kernel/torch {b / a:.3f}  greedy tokens equal {same}/{rows}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]))))
    else:
        main(sys.argv[1], [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3]))
