"""The lean attention kernel before (a worktree of the commit before) and after, in the default model's real CPU
decode steps (``harness.decode_step``, 2 torch threads, every row ``context`` tokens): lean-step rows (<= the row
limit) and rows past it (the torch ops' steps with the kernel). Each (tree, round) is a child process running in
its tree's folder (the library builds from that tree's ``lean_cpu.c``), the trees alternating every round; each
figure is the median over rounds of a child's median of REPEATS steps; the greedy tokens of both trees' first step
compared.

    python kernel_ab.py BASE_TREE NEW_TREE DTYPE CONTEXT ROWS ROUNDS
    python kernel_ab.py /tmp/wt-base "$PWD" bfloat16 2048 1,4,8,16,32 3   # from the repository root
"""
import json
import os
import statistics
import subprocess
import sys

REPEATS = int(os.environ.get("REPEATS", "5"))


def child(dtype: str, context: int, rows: list[int]) -> dict:
    sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "scripts")]
    from harness.decode_step import DecodeStepBench

    bench = DecodeStepBench(dtype=dtype, threads=2, context=context, max_rows=max(rows))
    out = {"lean_max_rows": bench.model.lean_max_rows}
    for n in rows:
        tokens = bench.step(n).tolist()
        bench.time_steps(n, repeats=1, warmup=1)
        out[n] = (statistics.median(bench.time_steps(n, repeats=REPEATS, warmup=0).samples_ms), tokens)
    return out


def main(base: str, new: str, dtype: str, context: int, rows: list[int], rounds: int) -> None:
    res = {"before": [], "after": []}
    for r in range(rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            tree = base if side == "before" else new
            text = subprocess.run([sys.executable, os.path.abspath(__file__), "child", dtype, str(context),
                                   ",".join(map(str, rows))], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                                  capture_output=True, text=True, check=True).stdout
            res[side].append(json.loads(text.strip().splitlines()[-1]))
    limit = res["after"][0]["lean_max_rows"]
    for n in rows:
        a = statistics.median(x[str(n)][0] for x in res["before"])
        b = statistics.median(x[str(n)][0] for x in res["after"])
        same = sum(x == y for x, y in zip(res["before"][0][str(n)][1], res["after"][0][str(n)][1]))
        kind = "lean step" if n <= limit else "torch ops + kernel"
        print(f"{dtype} ctx {context:5d} rows {n:3d} ({kind}): before {a:8.2f} ms  after {b:8.2f} ms  "
              f"after/before {b / a:.3f}  greedy tokens equal {same}/{n}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")])))
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(x) for x in sys.argv[5].split(",")],
             int(sys.argv[6]))
