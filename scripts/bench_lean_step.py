#!/usr/bin/env python
"""The decode step before and after a change, side by side in one run: ops per step, ms per step, engine tok/s.

One child process per (tree, dtype) loads the model as the engine does (``harness.decode_step``) and
answers commands; the parent interleaves them (before, after, before, after ...) so that both sides see
the same load on a shared machine, and reports medians of ``--rounds`` rounds:

* ops per one-row step: aten ops under ``torch.profiler`` (every level, and the top-level ones the
  Python side dispatches), one step after warm-up;
* ms per pure decode step at ``--rows`` (wall and this process's CPU time, ``--threads`` torch threads);
* engine tokens/s of one request alone (``LLM(None, device="cpu", dtype=...)``, a ``--prompt``-token
  prompt, ``--tokens`` greedy tokens, ``ignore_eos``): decode tok/s after the first token, and TTFT;
* the memory floor: weight bytes a step reads in full (``quantization.weight_bytes``) over the read
  bandwidth measured between rounds (best of a sum over a 512 MiB float32 tensor on ``--threads`` torch
  threads, as many as the step uses: a decode GEMV only reads its weights, so a copy's read + write figure
  is not the floor's; one thread reads about half of what two read on the 2-core VMs, 12.4 against 24.2
  GB/s, so a one-thread probe halves the floor of a two-thread step).

The "before" side is a worktree of ``--ref`` with this script and ``harness/`` copied in (the same
measuring code on both sides). Writes ``lean_step.json`` and ``lean_step.md`` into ``--out``.

Example:
    python scripts/bench_lean_step.py --ref c1d958d --rows 1,8,32 --out profiles/lean-decode-step-amd-epyc-2core
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness.common import COMMON, ROOT, log, ref_worktree
from harness.common import parser as script_parser

HERE = Path(__file__).resolve()
HARNESS = HERE.parent / "harness"


# ---- child side: runs inside one tree, imports that tree's package -----------------------------------------

def _count_ops(bench, rows: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    bench.step(rows)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bench.step(rows)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    del torch
    return {"all": len(events), "top": len(top)}


def _engine(dtype: str, prompt: int, tokens: int, threads: int) -> dict:
    from asyncbatch import LLM, SamplingParams

    llm = LLM(None, device="cpu", dtype=dtype, num_threads=threads)
    try:
        ids = [[100 + (i * 37) % 5000 for i in range(prompt)]]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(ids, params, use_tqdm=False)  # warm-up
        out = llm.generate(ids, params, use_tqdm=False)[0]
    finally:
        llm.close()
    m = out.metrics
    decode_s = m.finished_time - m.first_token_time
    return {"decode_tok_s": (len(out.token_ids) - 1) / decode_s, "ttft_ms": m.ttft * 1e3,
            "tokens": out.token_ids}


def child(dtype: str, threads: int, max_rows: int, context: int) -> int:
    import torch
    from harness.decode_step import DecodeStepBench

    bench = DecodeStepBench(None, dtype, None, max_rows=max_rows, context=context, threads=threads)
    print(json.dumps({"ready": True, "weight_bytes": bench.weight_bytes(), "commit": _commit()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "steps":
            t = bench.time_steps(cmd["rows"], repeats=cmd["repeats"], warmup=1)
            reply = {"median_ms": t.median_ms, "cpu_ms": t.cpu_median_ms}
        elif cmd["op"] == "ops":
            reply = _count_ops(bench, cmd["rows"])
        elif cmd["op"] == "engine":
            torch.set_num_threads(threads)
            reply = _engine(dtype, cmd["prompt"], cmd["tokens"], threads)
        else:
            break
        print(json.dumps(reply), flush=True)
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE.parent, check=False).stdout.strip()
    except OSError:
        return "?"


# ---- parent side ------------------------------------------------------------------------------------------

class Child:
    def __init__(self, tree: Path, dtype: str, threads: int, max_rows: int, context: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "scripts")]))
        script = tree / HERE.relative_to(ROOT)
        self.proc = subprocess.Popen([sys.executable, str(script), "--child", dtype, "--threads", str(threads),
                                      "--max-rows", str(max_rows), "--context", str(context)], cwd=tree, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"child exited with {self.proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def read_bandwidth_gb_s(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Best read bandwidth of a sum over ``mib`` MiB on ``threads`` torch threads (the step's own count)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    a.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return a.numel() * 4 / min(times) / 1e9


def markdown(doc: dict) -> str:
    lines = [f"# The decode step before ({doc['before']}) and after ({doc['after']}), side by side", "",
             f"Command: `{doc['command']}`", "",
             (f"{doc['rounds']} interleaved rounds, medians; {doc['threads']} torch thread(s); context {doc['context']} "
             f"per row; load average {doc['load_start']} at start, {doc['load_end']} at end."), "",
             (f"Read bandwidth (sum over 512 MiB, {doc['threads']} thread(s)): median of rounds' best {doc['bandwidth_gb_s']:.1f} GB/s "
             f"(per round: {', '.join(f'{b:.1f}' for b in doc['bandwidth_rounds'])})."), ""]
    for dtype, d in doc["dtypes"].items():
        lines += [f"## {dtype}", "",
                  (f"Weights read per step: before {d['before']['weight_mib']:.0f} MiB, after "
                  f"{d['after']['weight_mib']:.0f} MiB; memory floor {d['floor_ms']:.1f} ms."), "",
                  "| figure | before | after | after / before |", "|---|---|---|---|"]
        for key, label in (("ops_all", "aten ops per 1-row step (all levels)"),
                           ("ops_top", "aten ops per 1-row step (top level)")):
            b, a = d["before"][key], d["after"][key]
            lines.append(f"| {label} | {b:.0f} | {a:.0f} | {a / b:.2f} |")
        for r in doc["rows"]:
            for key, label in (("ms", "wall ms"), ("cpu_ms", "CPU ms")):
                b, a = d["before"][f"{key}_{r}"], d["after"][f"{key}_{r}"]
                lines.append(f"| {r}-row step, {label} | {b:.1f} | {a:.1f} | {a / b:.2f} |")
        if "decode_tok_s" in d["after"]:
            for key, label in (("decode_tok_s", "engine, one request: decode tok/s"), ("ttft_ms", "engine TTFT ms")):
                b, a = d["before"][key], d["after"][key]
                lines.append(f"| {label} | {b:.1f} | {a:.1f} | {a / b:.2f} |")
            lines.append(f"| engine greedy tokens equal | | {d['tokens_equal']} | |")
        r1 = d["after"]["ms_1"] / d["floor_ms"]
        lines += ["", (f"1-row step / memory floor: before {d['before']['ms_1'] / d['floor_ms']:.2f}x, after {r1:.2f}x "
                  "(wall)."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--child", default=None, help=argparse_hidden())
    parser.add_argument("--ref", default="c1d958d", help="the 'before' commit")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="steps per timing (their median)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-rows", type=int, default=32)
    parser.add_argument("--no-engine", action="store_true")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.threads, args.max_rows, args.context)
    rows = [int(x) for x in args.rows.split(",")]
    dtypes = args.dtypes.split(",")
    doc = {"command": " ".join(["scripts/bench_lean_step.py", *(argv or sys.argv[1:])]), "rows": rows,
           "rounds": args.rounds, "threads": args.threads, "context": args.context,
           "load_start": [round(x, 2) for x in os.getloadavg()], "dtypes": {}, "bandwidth_rounds": []}
    with ref_worktree(args.ref, [HERE, COMMON, *sorted(HARNESS.glob("*.py"))]) as ref_tree:
        trees = {"before": ref_tree, "after": ROOT}
        samples: dict = {dt: {side: {} for side in trees} for dt in dtypes}
        children = {}
        for dt in dtypes:
            for side, tree in trees.items():
                log(f"loading {side} {dt} ...")
                children[dt, side] = Child(tree, dt, args.threads, max(args.max_rows, max(rows)), args.context)
        doc["before"], doc["after"] = children[dtypes[0], "before"].info["commit"], children[dtypes[0], "after"].info["commit"]
        tokens: dict = {}
        try:
            for rnd in range(args.rounds):
                doc["bandwidth_rounds"].append(read_bandwidth_gb_s(args.threads))
                log(f"round {rnd + 1}: bandwidth {doc['bandwidth_rounds'][-1]:.1f} GB/s")
                for dt in dtypes:
                    for r in rows:
                        for side in trees:
                            t = children[dt, side].ask(op="steps", rows=r, repeats=args.repeats)
                            samples[dt][side].setdefault(f"ms_{r}", []).append(t["median_ms"])
                            samples[dt][side].setdefault(f"cpu_ms_{r}", []).append(t["cpu_ms"])
                            log(f"  {dt} {side} {r} rows: {t['median_ms']:.1f} ms (CPU {t['cpu_ms']:.1f})")
                    if rnd == 0:
                        for side in trees:
                            ops = children[dt, side].ask(op="ops", rows=1)
                            samples[dt][side]["ops_all"], samples[dt][side]["ops_top"] = [ops["all"]], [ops["top"]]
                    if not args.no_engine:
                        for side in trees:
                            e = children[dt, side].ask(op="engine", prompt=args.prompt, tokens=args.tokens)
                            samples[dt][side].setdefault("decode_tok_s", []).append(e["decode_tok_s"])
                            samples[dt][side].setdefault("ttft_ms", []).append(e["ttft_ms"])
                            tokens[dt, side] = e["tokens"]
                            log(f"  {dt} {side} engine: {e['decode_tok_s']:.1f} tok/s, TTFT {e['ttft_ms']:.0f} ms")
        finally:
            for c in children.values():
                c.close()
    doc["bandwidth_gb_s"] = statistics.median(doc["bandwidth_rounds"])
    for dt in dtypes:
        d = {}
        for side in trees:
            d[side] = {k: statistics.median(v) for k, v in samples[dt][side].items()}
            d[side]["samples"] = samples[dt][side]
            d[side]["weight_mib"] = children[dt, side].info["weight_bytes"] / 2**20
        d["floor_ms"] = children[dt, "after"].info["weight_bytes"] / (doc["bandwidth_gb_s"] * 1e9) * 1e3
        if not args.no_engine:
            d["tokens_equal"] = tokens[dt, "before"] == tokens[dt, "after"]
        doc["dtypes"][dt] = d
    doc["load_end"] = [round(x, 2) for x in os.getloadavg()]
    text = markdown(doc)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lean_step.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "lean_step.md").write_text(text + "\n")
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    raise SystemExit(main())
