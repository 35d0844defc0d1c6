"""The main job of the README: one chat generation, then a short throughput table.

The table runs the same requests through overlap and synchronous mode: both
engines are loaded side by side, and ``--rounds`` rounds alternate between
them (overlap, sync, overlap, sync, ...), each round a fresh slice of the
workload that both modes run. A shared machine's speed drifts by the minute;
alternating puts both modes under the same drift, and the ratio printed is
the median of the rounds' ratios, with their range beside it.

    round      1               2               3
    overlap  [slice 1]       [slice 2]       [slice 3]
    sync              [slice 1]       [slice 2]       [slice 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING

from asyncbatch.bench.workloads import uniform_requests
from asyncbatch.cli.args import engine_kwargs, precision_text
from asyncbatch.engine.fork_server import start_early
from asyncbatch.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncbatch.llm import LLM

MODES = ("overlap", "sync")


def _throughput(llm: LLM, items) -> dict:
    # Explicit seeds: a request's default seed follows its arrival order, and the overlap engine served the
    # chat request first (the simulated device's pseudo-tokens depend on the seed; greedy tokens do not).
    params = [SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True, seed=i)
              for i, it in enumerate(items)]
    llm.reset_stats()
    start = time.perf_counter()
    outs = llm.generate([it.prompt_token_ids for it in items], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    stats = llm.stats()
    return {"output_tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
            "busy": stats["device_busy_fraction"], "gap_ms": stats["idle_gap_ms_mean"],
            "planner_ms": stats["planner_ms_per_step"], "steps": stats["steps"],
            "token_ids": [o.token_ids for o in outs]}


def _chat(llm: LLM, load_s: float) -> None:
    message = "Write one sentence about why GPUs should never wait for CPUs."
    out = llm.chat([{"role": "user", "content": message}], SamplingParams(max_tokens=48, temperature=0.0),
                   use_tqdm=False)[0]
    sim = " (simulated device: pseudo-tokens)" if llm.simulated else f" in {precision_text(llm.executor_info)}"
    print(f"model: {llm.model_path} on {llm.device}{sim}, loaded in {load_s:.2f} s")
    print(f"user: {message}\nassistant: {out.text.strip()}\n"
          f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, "
          f"TTFT {1e3 * (out.metrics.ttft or 0):.0f} ms, latency {out.metrics.latency:.2f} s]\n")


def run_demo(args: argparse.Namespace) -> int:
    start_early()  # the core's fork server imports the engine beside this process (engine.fork_server)
    from asyncbatch.llm import LLM  # torch, transformers: not for other commands (asyncbatch/__init__.py)

    rounds = args.rounds  # >= 1: the option's type (positive_int)
    with ExitStack() as stack:
        engines = {}
        for mode in MODES:
            t0 = time.perf_counter()
            engines[mode] = stack.enter_context(LLM(args.model, **engine_kwargs(args, mode == "overlap")))
            if mode == "overlap":
                _chat(engines[mode], time.perf_counter() - t0)
        n = args.num_requests
        items = uniform_requests(n * (rounds + 1), (16, 128), (8, 128), engines["overlap"].tokenizer.vocab_size,
                                 seed=0)
        for llm in engines.values():
            _throughput(llm, items[-4:])  # warm-up, on requests no round runs
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            for mode in MODES:
                runs[mode].append(_throughput(engines[mode], items[r * n:(r + 1) * n]))
    same = all(a.pop("token_ids") == b.pop("token_ids") for a, b in zip(runs["overlap"], runs["sync"]))
    print(f"throughput: {n} requests a round, {rounds} rounds alternating between the modes, prompts 16-128 tokens, "
          f"outputs 8-128 tokens (ignore_eos), greedy, device={args.device}; medians of the rounds")
    header = f"{'mode':<8} {'out tok/s':>10} {'wall s':>8} {'steps':>6} {'busy %':>7} {'gap ms':>7} {'plan ms':>8}"
    print(header)
    print("-" * len(header))
    for mode in MODES:
        m = {key: statistics.median(run[key] for run in runs[mode]) for key in runs[mode][0]}
        print(f"{mode:<8} {m['tok_per_s']:>10.1f} {m['wall_s']:>8.2f} {round(m['steps']):>6d} "
              f"{100 * m['busy']:>7.1f} {m['gap_ms']:>7.2f} {m['planner_ms']:>8.2f}")
    ratios = [a["tok_per_s"] / b["tok_per_s"] for a, b in zip(runs["overlap"], runs["sync"])]
    spread = f" (rounds {min(ratios):.2f}-{max(ratios):.2f})" if rounds > 1 else ""
    print(f"overlap/sync throughput ratio: {statistics.median(ratios):.2f}x{spread}; "
          f"identical tokens in both modes: {same}")
    return 0 if same else 1
