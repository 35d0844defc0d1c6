"""A burst of requests that share a prompt prefix, admitted together: this tree against another commit.

    python scripts/bench_shared_burst.py --ref HEAD~1 --out profiles/shared-prefix-burst-<machine>
    python scripts/bench_shared_burst.py --ref HEAD~1 --devices sim --rounds 5

``--num-requests`` requests arrive at once: a ``--system-len``-token system prompt and a
``--question-len``-token question each (``--parallel-samples K``: instead, K completions of each of
``--num-requests / K`` whole prompts, ``SamplingParams.n``). Greedy, ``ignore_eos``, ``--output-len`` tokens,
overlap mode, prefix caching on, the engine warmed up on other prompts and its cache emptied before the burst.

Reported per tree and device, medians over ``--rounds`` (the trees alternate, each run a fresh process):
prompt tokens computed (``prompt_tokens - cached_tokens`` of ``prefix_cache_stats``), the reused share,
deferred admissions, TTFT mean and P99 (nearest rank: the largest below 100 outputs; with ``n`` one output a
prompt, its first token's time), the burst's run time, steps; and whether both trees gave the same
greedy tokens. ``cpu``: the default model, float32, one-request-per-core threads (real execution); ``sim``:
the simulated device's default cost model (modelled times, real planner).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.common import COMMON, ROOT, log, parser, ref_worktree, run_in_tree

SCRIPT = Path(__file__).resolve()


def child(args) -> dict:
    """One run in this process's tree: the burst, measured."""
    from asyncbatch import LLM, SamplingParams

    per_prompt = args.parallel_samples
    with LLM(device=args.device, dtype="float32" if args.device == "cpu" else "auto", engine_process=True,
             max_num_batched_tokens=args.max_num_batched_tokens, num_threads=None) as llm:
        vocab = 1000  # ids well inside the default model's vocabulary, distinct per role
        warm = [[vocab + 7 * i + j for j in range(24)] for i in range(4)]
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.reset_prefix_cache()
        system = [2000 + (i * 37) % 3000 for i in range(args.system_len)]
        num_prompts = args.num_requests // per_prompt
        prompts = [system + [6000 + (q * 131 + j * 17) % 3000 for j in range(args.question_len)]
                   for q in range(num_prompts)]
        kwargs = {"n": per_prompt} if per_prompt > 1 else {}
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0 if per_prompt == 1 else 0.8, seed=3,
                                ignore_eos=True, **kwargs)
        before = llm.prefix_cache_stats()
        steps_before = llm.stats().get("steps", 0)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        run_s = time.perf_counter() - started
        after = llm.prefix_cache_stats()
        llm.wait_settled(30)
        stats = llm.stats()
        completions = [c for o in outputs for c in (o.outputs if hasattr(o, "outputs") else [o])]
        ttfts = sorted(o.metrics.ttft for o in outputs)  # a merged output's metrics span its completions
        prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["cached_tokens"] - before["cached_tokens"]
        tokens = hashlib.sha256(json.dumps([c.token_ids for c in completions]).encode()).hexdigest()[:16]
        return {"prompt_tokens": prompt_tokens, "computed_tokens": prompt_tokens - cached,
                "reused_share": cached / prompt_tokens if prompt_tokens else 0.0,
                "deferred_admissions": after.get("deferred_admissions", 0) - before.get("deferred_admissions", 0),
                "ttft_mean_ms": 1e3 * statistics.fmean(ttfts),
                "ttft_p99_ms": 1e3 * ttfts[math.ceil(0.99 * len(ttfts)) - 1],
                "run_s": run_s, "steps": stats.get("steps", 0) - steps_before, "completions": len(completions),
                "tokens_sha": tokens}


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--ref", default="HEAD~1", help="the commit to compare against")
    cli.add_argument("--devices", nargs="+", default=["sim", "cpu"], choices=["sim", "cpu"])
    cli.add_argument("--num-requests", type=int, default=32)
    cli.add_argument("--system-len", type=int, default=256)
    cli.add_argument("--question-len", type=int, default=16)
    cli.add_argument("--output-len", type=int, default=16)
    cli.add_argument("--parallel-samples", type=int, default=1)
    cli.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cli.add_argument("--rounds", type=int, default=3)
    cli.add_argument("--out", type=Path, default=None, help="a folder for report.json")
    cli.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    cli.add_argument("--device", default="sim", help=argparse.SUPPRESS)
    args = cli.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    passed = [f"--num-requests={args.num_requests}", f"--system-len={args.system_len}",
              f"--question-len={args.question_len}", f"--output-len={args.output_len}",
              f"--parallel-samples={args.parallel_samples}", f"--max-num-batched-tokens={args.max_num_batched_tokens}"]
    runs: dict[str, dict[str, list[dict]]] = {device: {"this": [], "ref": []} for device in args.devices}
    with ref_worktree(args.ref, [SCRIPT, COMMON]) as ref_tree:
        for r in range(args.rounds):
            for device in args.devices:
                order = [("this", ROOT), ("ref", ref_tree)]
                for name, tree in order if r % 2 == 0 else order[::-1]:
                    done = run_in_tree(tree, SCRIPT, ["--child", f"--device={device}", *passed], timeout_s=1800)
                    if done.returncode != 0:
                        raise SystemExit(f"{name} on {device} failed:\n{done.stderr[-3000:]}")
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    runs[device][name].append(result)
                    log(f"round {r + 1} {device} {name}: {result}")
    report = {"ref": args.ref, "args": vars(args) | {"out": str(args.out)}, "runs": runs, "medians": {}}
    for device, by_tree in runs.items():
        medians = {name: {key: statistics.median(run[key] for run in results) for key in results[0]
                          if isinstance(results[0][key], (int, float))} for name, results in by_tree.items()}
        same = {run["tokens_sha"] for results in by_tree.values() for run in results}
        report["medians"][device] = medians | {"same_tokens": len(same) == 1}
        print(f"\n{device} (medians of {args.rounds}; same greedy tokens in both trees: {len(same) == 1})")
        print(f"| metric | this tree | {args.ref} | {args.ref} / this |")
        print("|---|---:|---:|---:|")
        for key in medians["this"]:
            a, b = medians["this"][key], medians["ref"][key]
            print(f"| {key} | {a:,.3f} | {b:,.3f} | {b / a if a else float('nan'):.2f}x |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
