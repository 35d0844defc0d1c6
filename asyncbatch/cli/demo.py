"""The main job of the README: one chat generation, then a short throughput table.

The table runs the same requests through overlap and synchronous mode, one
after the other in the same process, so the ratio is a side-by-side figure.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from asyncbatch.bench.workloads import uniform_requests
from asyncbatch.cli.args import engine_kwargs, precision_text
from asyncbatch.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncbatch.llm import LLM


def _throughput(llm: LLM, items, label: str) -> dict:
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
    return {"mode": label, "requests": len(outs), "output_tokens": tokens, "wall_s": wall,
            "tok_per_s": tokens / wall, "busy": stats["device_busy_fraction"],
            "gap_ms": stats["idle_gap_ms_mean"], "planner_ms": stats["planner_ms_per_step"],
            "steps": stats["steps"], "token_ids": [o.token_ids for o in outs]}


def run_demo(args: argparse.Namespace) -> int:
    from asyncbatch.llm import LLM  # torch, transformers: not for other commands (asyncbatch/__init__.py)

    message = "Write one sentence about why GPUs should never wait for CPUs."
    rows = []
    for overlap in (True, False):
        t0 = time.perf_counter()
        with LLM(args.model, **engine_kwargs(args, overlap)) as llm:
            load_s = time.perf_counter() - t0
            if overlap:
                out = llm.chat([{"role": "user", "content": message}], SamplingParams(max_tokens=48, temperature=0.0),
                               use_tqdm=False)[0]
                sim = (" (simulated device: pseudo-tokens)" if llm.simulated
                       else f" in {precision_text(llm.executor_info)}")
                print(f"model: {llm.model_path} on {llm.device}{sim}, loaded in {load_s:.2f} s")
                print(f"user: {message}\nassistant: {out.text.strip()}\n"
                      f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, "
                      f"TTFT {1e3 * (out.metrics.ttft or 0):.0f} ms, latency {out.metrics.latency:.2f} s]\n")
            items = uniform_requests(args.num_requests, (16, 128), (8, 128), llm.tokenizer.vocab_size, seed=0)
            _throughput(llm, items[:4], "warmup")
            rows.append(_throughput(llm, items, "overlap" if overlap else "sync"))
    same = rows[0].pop("token_ids") == rows[1].pop("token_ids")
    print(f"throughput: {args.num_requests} requests, prompts 16-128 tokens, outputs 8-128 tokens (ignore_eos), "
          f"greedy, device={args.device}")
    header = f"{'mode':<8} {'out tok/s':>10} {'wall s':>8} {'steps':>6} {'busy %':>7} {'gap ms':>7} {'plan ms':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mode']:<8} {r['tok_per_s']:>10.1f} {r['wall_s']:>8.2f} {r['steps']:>6d} "
              f"{100 * r['busy']:>7.1f} {r['gap_ms']:>7.2f} {r['planner_ms']:>8.2f}")
    print(f"overlap/sync throughput ratio: {rows[0]['tok_per_s'] / rows[1]['tok_per_s']:.2f}x; "
          f"identical tokens in both modes: {same}")
    return 0 if same else 1
