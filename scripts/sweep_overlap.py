#!/usr/bin/env python
"""Overlap versus synchronous mode across device step times and batch sizes.

Part 1 (simulated device): a sweep of step time x running requests, reporting
busy fraction and throughput of both modes, their ratio, and the ideal ratio
(host + device) / max(host, device), where host is the synchronous idle time
per step (planning, applying, output processing) and device the step time.
Part 2 (real CPU execution): a tiny model whose forward takes about as long as
planning, both modes side by side.
Every sim figure is labelled simulated. Writes a JSON next to the printed table.

    python scripts/sweep_overlap.py --out profiles/sweep-overlap
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from asyncbatch import LLM, SamplingParams, SimConfig
from asyncbatch.bench.report import write_json
from asyncbatch.profiling.host_info import cpu_name, git_commit
from asyncbatch.profiling.timeline import steady_decode_window, summarize


def decode_window_stats(llm: LLM, min_decode: int) -> dict:
    records = llm.timeline.window()
    return summarize(steady_decode_window(records, min_decode) or records)


def run_sim(step_ms: float, running: int, overlap: bool, decode_steps: int) -> dict:
    sim = SimConfig(step_fixed_ms=step_ms, per_token_us=0.0, per_context_token_ns=0.0,
                    output_len_distribution="fixed", output_len_max=decode_steps)
    with LLM(device="sim", sim=sim, overlap=overlap, max_num_seqs=max(running, 16),
             max_num_batched_tokens=max(2048, running)) as llm:
        prompts = [[300 + i] * (16 + (i * 7) % 112) for i in range(running)]
        params = SamplingParams(max_tokens=decode_steps, temperature=0.0)
        llm.generate(prompts[:4], params, use_tqdm=False)
        llm.reset_stats()
        llm.reset_prefix_cache()  # the warm-up's prompts must not be cached for the timed run
        llm.generate(prompts, params, use_tqdm=False)
        return decode_window_stats(llm, min_decode=max(1, int(running * 0.9)))


def sim_sweep(steps_ms: list[float], batch_sizes: list[int], decode_steps: int) -> list[dict]:
    rows = []
    for running in batch_sizes:
        for step_ms in steps_ms:
            over = run_sim(step_ms, running, True, decode_steps)
            sync = run_sim(step_ms, running, False, decode_steps)
            host = sync["idle_gap_ms_mean"]
            rows.append({
                "backend": "sim (simulated)", "step_ms": step_ms, "running": running,
                "busy_overlap": over["device_busy_fraction"], "busy_sync": sync["device_busy_fraction"],
                "tok_s_overlap": over["output_tokens_per_s"], "tok_s_sync": sync["output_tokens_per_s"],
                "ratio": over["output_tokens_per_s"] / sync["output_tokens_per_s"],
                "ideal_ratio": (host + step_ms) / max(host, step_ms),
                "planner_ms": over["planner_ms_per_step"], "sync_host_ms": host,
            })
            r = rows[-1]
            print(f"{running:>5} {step_ms:>6.1f} {100 * r['busy_overlap']:>7.2f} {100 * r['busy_sync']:>7.2f} "
                  f"{r['tok_s_overlap']:>10.0f} {r['tok_s_sync']:>10.0f} {r['ratio']:>6.2f} {r['ideal_ratio']:>6.2f} "
                  f"{r['planner_ms']:>7.3f} {host:>7.3f}", flush=True)
    return rows


def cpu_tiny(repeats: int) -> dict:
    """A tiny Llama on the CPU backend, both modes on the same requests, alternating, medians."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(Path(tmp) / "tiny", "LlamaForCausalLM", num_hidden_layers=4, hidden_size=128,
                               intermediate_size=256, max_position_embeddings=512)
        prompts = [[3 + (i * 7 + j) % 250 for j in range(8 + i % 24)] for i in range(64)]
        params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
        results: dict[str, list[dict]] = {"overlap": [], "sync": []}
        # One intra-op thread in both modes: on a 2-core machine the other core is the host's (planner,
        # output), as a GPU leaves the CPU to the host. With both cores for torch, the planner of the
        # overlap mode would steal cycles from the very "device" it is meant to keep busy.
        engines = {mode: LLM(str(path), device="cpu", overlap=mode == "overlap", max_num_seqs=64, num_threads=1)
                   for mode in results}
        try:
            for llm in engines.values():
                llm.generate(prompts[:4], params, use_tqdm=False)
            for _ in range(repeats):
                for mode, llm in engines.items():
                    llm.reset_stats()
                    llm.reset_prefix_cache()
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    wall = time.perf_counter() - t0
                    stats = llm.stats()
                    stats["wall_tok_s"] = sum(len(o.token_ids) for o in outs) / wall
                    results[mode].append(stats)
        finally:
            for llm in engines.values():
                llm.close()
    summary = {}
    for mode, runs in results.items():
        summary[mode] = {k: statistics.median(r[k] for r in runs) for k in
                         ("wall_tok_s", "device_busy_fraction", "idle_gap_ms_mean", "planner_ms_per_step",
                          "device_ms_per_step")}
    summary["ratio"] = summary["overlap"]["wall_tok_s"] / summary["sync"]["wall_tok_s"]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-ms", type=float, nargs="+", default=[0.5, 1, 2, 5, 10])
    parser.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--decode-steps", type=int, default=150)
    parser.add_argument("--cpu-repeats", type=int, default=3)
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--out", default=None, help="directory for sweep.json")
    args = parser.parse_args()
    print("simulated device (sim): steady decode window, both modes on the same requests")
    print(f"{'run':>5} {'dev ms':>6} {'busy% o':>7} {'busy% s':>7} {'tok/s o':>10} {'tok/s s':>10} {'ratio':>6} "
          f"{'ideal':>6} {'plan ms':>7} {'host ms':>7}")
    rows = sim_sweep(args.steps_ms, args.running, args.decode_steps)
    report = {"machine": cpu_name(), "cpu_count": os.cpu_count(), "commit": git_commit() or "", "sim": rows}
    if not args.skip_cpu:
        cpu = cpu_tiny(args.cpu_repeats)
        report["cpu_tiny"] = cpu
        o, s = cpu["overlap"], cpu["sync"]
        print(f"\ncpu backend (1 torch thread), tiny Llama (4 layers, hidden 128), 64 requests x 96 tokens, medians of "
              f"{args.cpu_repeats}:\n  overlap {o['wall_tok_s']:.0f} tok/s (busy {100 * o['device_busy_fraction']:.1f}%,"
              f" device {o['device_ms_per_step']:.2f} ms/step, planner {o['planner_ms_per_step']:.2f} ms/step)\n"
              f"  sync    {s['wall_tok_s']:.0f} tok/s (busy {100 * s['device_busy_fraction']:.1f}%, idle gap "
              f"{s['idle_gap_ms_mean']:.2f} ms/step)\n  overlap/sync = {cpu['ratio']:.2f}x")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(report, out / "sweep.json", nan_as_null=True, indent=2)
        print(f"\nwrote {out / 'sweep.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
