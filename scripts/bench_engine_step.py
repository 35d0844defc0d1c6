#!/usr/bin/env python
"""The engine's decode step against the bare model's, this tree beside another, side by side in one run.

What a CPU engine adds to a decode step is the question: the bare step (``harness.decode_step``, forward +
greedy sampling on the main thread, nothing else in the process) is what the model costs; the engine's
step is ``device_ms_per_step`` from ``stats()`` (its device thread), and the user sees tokens/s. Per tree
and dtype, one fresh interpreter (``PYTHONPATH`` = the tree, the same copy of this script) measures:

* ``bare_1row_ms``: the bare one-row step at context 128, median of 9 (``--threads`` kernel threads);
* ``one_*``: one request alone (a 64-token prompt, 128 greedy tokens, ``ignore_eos``; engine in its own
  process, overlap): decode tokens/s after the first token, and the engine's device ms per step;
* ``batch_*``: 32 requests x (64 prompt + 128 output) tokens at once: output tokens/s and device ms per step.

Trees alternate within each round (before, after, before, ...), so load from other users hits both alike;
medians of ``--rounds`` rounds are printed and every round is kept in ``--json``.

    python scripts/bench_engine_step.py --ref fd8aab7 --json /tmp/engine_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.common import COMMON, ROOT, log, ref_worktree, run_in_tree
from harness.common import parser as script_parser

PROMPT, TOKENS, BATCH = 64, 128, 32


def _prompts(n: int) -> list[list[int]]:
    return [[100 + (i * 37 + 11 * j) % 5000 for i in range(PROMPT)] for j in range(n)]


def _engine_run(llm, n: int) -> dict:
    from asyncbatch import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    llm.generate(_prompts(n)[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0)
    llm.reset_stats()
    start = time.perf_counter()
    outputs = llm.generate(_prompts(n), params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = llm.stats()
    first = outputs[0].metrics
    return {"decode_tok_s": (len(outputs[0].token_ids) - 1) / (first.finished_time - first.first_token_time),
            "output_tok_s": sum(len(o.token_ids) for o in outputs) / wall,
            "device_ms": stats["device_ms_per_step"], "tokens": [o.token_ids for o in outputs]}


def child(dtype: str, threads: int) -> dict:
    import torch
    from harness.decode_step import DecodeStepBench

    from asyncbatch import LLM

    bench = DecodeStepBench(None, dtype, None, max_rows=2, context=128, threads=threads)
    bare = bench.time_steps(1, repeats=9, warmup=2).median_ms
    del bench
    torch.set_num_threads(threads)
    with LLM(None, device="cpu", dtype=dtype, num_threads=threads, seed=0) as llm:
        one = _engine_run(llm, 1)
        batch = _engine_run(llm, BATCH)
    return {"bare_1row_ms": bare, "one_decode_tok_s": one["decode_tok_s"], "one_device_ms": one["device_ms"],
            "batch_output_tok_s": batch["output_tok_s"], "batch_device_ms": batch["device_ms"],
            # a digest of every greedy token, compared between trees (the tokens themselves would bloat the JSON)
            "tokens_sha1": hashlib.sha1(json.dumps(one["tokens"] + batch["tokens"]).encode()).hexdigest(),
            "load_avg": os.getloadavg()[0]}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--ref", help="the commit to compare against (a temporary worktree is made)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("DTYPE", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    with ref_worktree(args.ref, [Path(__file__), COMMON, COMMON.parent / "decode_step.py"]) if args.ref \
            else contextlib.nullcontext() as ref:
        trees = {**({"before": ref} if ref else {}), "after": ROOT}
        runs: dict[str, dict[str, list[dict]]] = {d: {name: [] for name in trees} for d in args.dtypes.split(",")}
        for round_ in range(args.rounds):
            for dtype in runs:
                for name, tree in trees.items():
                    done = run_in_tree(tree, Path(__file__), ["--child", dtype, str(args.threads)], timeout_s=900)
                    if done.returncode:
                        raise RuntimeError(f"{dtype} in {tree} failed:\n{done.stderr[-3000:]}")
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    runs[dtype][name].append(result)
                    log(f"round {round_ + 1} {dtype} {name}: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float)))
    for dtype, by_tree in runs.items():
        print(f"\n{dtype}, {args.threads} kernel threads, medians of {args.rounds}")
        for key in ("bare_1row_ms", "one_decode_tok_s", "one_device_ms", "batch_output_tok_s", "batch_device_ms"):
            cells = {name: statistics.median(r[key] for r in rs) for name, rs in by_tree.items()}
            ratio = f"   after/before {cells['after'] / cells['before']:.2f}" if "before" in cells else ""
            print(f"  {key:20s} " + "   ".join(f"{n} {v:8.2f}" for n, v in cells.items()) + ratio)
        if "before" in by_tree:
            same = all(b["tokens_sha1"] == a["tokens_sha1"] for b, a in zip(by_tree["before"], by_tree["after"]))
            print(f"  greedy tokens identical before/after: {same}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
