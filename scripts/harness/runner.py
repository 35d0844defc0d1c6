"""Runs every system on the same requests, repeatedly, and keeps what the report needs.

Order: for each repeat, for each request rate, every system once, with the
system order rotated from one repeat to the next, so slow drifts of a shared
machine (other jobs, thermal state) spread over all systems instead of
biasing whichever always runs last. A progress bar counts the runs.

The first run of each system also yields its token ids, compared against the
reference system's (asyncbatch overlap when present) as a sanity check that
the systems did the same work.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from asyncbatch.bench.arrivals import arrival_offsets
from asyncbatch.bench.host_load import HostLoad
from asyncbatch.bench.workloads import WORKLOADS, WorkItem
from harness.records import RunResult
from harness.run_metrics import run_metrics, summarize_runs
from harness.system_base import BenchSettings, BenchSystem
from harness.systems import OPTIONAL, OVERLAP, build_system, parse_systems

CDF_POINTS = 101  # quantiles stored per metric: enough for a smooth CDF, small JSON at any scale


def add_common_args(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--model", default=None, help="model path or name (default: asyncbatch's SmolLM2-135M)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--systems", default="all",
                   help="'all' or a comma list of: overlap, sync, generate_batch, static, llamacpp "
                        "(llama.cpp: needs the llamacpp extra, skipped with a message without it)")
    p.add_argument("--workload", default="random", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (default: 256 for nanovllm, else 64); nanovllm takes its first N")
    p.add_argument("--input-len", type=int, default=128, help="random workload: mean prompt length")
    p.add_argument("--output-len", type=int, default=128, help="random workload: mean output length")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random workload: lengths in len*(1±r)")
    p.add_argument("--prompt-range", default="16,128", help="uniform workload: inclusive prompt length range")
    p.add_argument("--output-range", default="8,128", help="uniform workload: inclusive output length range")
    p.add_argument("--system-len", type=int, default=512, help="shared_prefix/multiturn: shared system prompt")
    p.add_argument("--question-len", type=int, default=32, help="shared_prefix/multiturn: tokens per question")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--prefix-caching", default="on", choices=("on", "off"),
                   help="asyncbatch's prefix cache (emptied before every timed run either way)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (all systems)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="max requests per step (all batching systems)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="max tokens per step")
    p.add_argument("--static-batch-size", type=int, default=8)
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--results-dir", required=True, help="where the JSON and PNG files go")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def settings_from_args(args: argparse.Namespace, ignore_eos: bool) -> BenchSettings:
    return BenchSettings(model=args.model, device=args.device, dtype=args.dtype, temperature=args.temperature,
                         ignore_eos=ignore_eos, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         static_batch_size=args.static_batch_size, seed=args.seed,
                         enable_prefix_caching=args.prefix_caching == "on")


@dataclass
class PointData:
    """All repeats of one system at one request rate (None: offline)."""

    metrics: list[dict] = field(default_factory=list)
    samples: dict[str, list[float]] = field(default_factory=lambda: {"ttft_ms": [], "tpot_ms": [], "itl_ms": [],
                                                                      "e2e_ms": []})

    def add(self, run: RunResult) -> dict:
        m = run_metrics(run)
        self.metrics.append(m)
        for r in run.requests:
            for key, value in (("ttft_ms", r.ttft), ("tpot_ms", r.tpot), ("e2e_ms", r.latency)):
                if value is not None:
                    self.samples[key].append(value * 1e3)
            self.samples["itl_ms"].extend(g * 1e3 for g in r.itls())
        return m

    def as_dict(self, rate: float | None) -> dict:
        cdf = {k: np.percentile(np.array(v), np.linspace(0, 100, CDF_POINTS)).tolist() if v else None
               for k, v in self.samples.items()}
        return {"request_rate": rate_key(rate), "runs": self.metrics, "summary": summarize_runs(self.metrics),
                "cdf": cdf}


def rate_key(rate: float | None) -> float | str | None:
    """JSON has no infinity: an all-at-once rate is written as the string "inf"."""
    if rate is None:
        return None
    return "inf" if math.isinf(rate) else rate


@dataclass
class SystemData:
    name: str
    description: str
    config: dict
    load_mib: float
    points: dict[float | None, PointData] = field(default_factory=dict)
    first_tokens: list[list[int]] | None = None


def build_systems(names: str, settings: BenchSettings, warmup: list[WorkItem], log=print) -> list[BenchSystem]:
    from harness.system_llamacpp import LlamaCppUnavailable

    systems: list[BenchSystem] = []
    try:
        for name in parse_systems(names):
            log(f"building {name} ...")
            try:
                system = build_system(name, settings)
            except LlamaCppUnavailable as exc:
                if name not in OPTIONAL:
                    raise
                log(f"skipping {name}: {exc}")
                continue
            systems.append(system)
            if warmup:
                system.warmup(warmup)
    except BaseException:
        for system in systems:
            system.close()
        raise
    return systems


def warmup_items(items: list[WorkItem], n: int) -> list[WorkItem]:
    """The first ``n`` requests, outputs capped at 8 tokens: enough to touch every code path once."""
    return [WorkItem(it.prompt_token_ids, min(it.max_tokens, 8)) for it in items[:n]]


def run_all(systems: list[BenchSystem], items: list[WorkItem], rates: list[float | None], repeats: int,
            burstiness: float = 1.0, seed: int = 0, progress: bool = True) -> list[SystemData]:
    """Every system x rate x repeat; ``rates == [None]`` is the offline (all-at-once, ``generate``) run."""
    data = {s.name: SystemData(s.name, s.description, s.config(), s.load_mib) for s in systems}
    total = repeats * len(rates) * len(systems)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    try:
        for rep in range(repeats):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for rate in rates:
                offsets = None if rate is None else arrival_offsets(len(items), rate, burstiness, seed)
                for system in order:
                    bar.set_postfix_str(f"{system.name} rate={rate_key(rate)} rep={rep + 1}")
                    with HostLoad() as host:
                        run = system.run_offline(items) if offsets is None else system.run_online(items, offsets)
                    run.request_rate, run.host = rate, host.result()
                    entry = data[system.name]
                    m = entry.points.setdefault(rate, PointData()).add(run)
                    if entry.first_tokens is None:
                        entry.first_tokens = [r.token_ids for r in run.requests]
                    bar.update(1)
                    contention = run.host.get("contention")
                    bar.write(f"  {system.name:<28} rate={rate_key(rate)!s:<6} rep {rep + 1}/{repeats}: "
                              f"{m['output_throughput']:8.1f} out tok/s, {m['duration_s']:7.2f} s, "
                              f"{m['output_tokens_per_cpu_s'] or 0:7.1f} out tok/CPU-s, others took "
                              f"{'?' if contention is None else f'{100 * contention:.0f}%'} of the CPUs")
        for system in systems:
            config = system.config()  # filled in by the first run for some systems
            data[system.name].config = config
    finally:
        bar.close()
    return [data[s.name] for s in systems]


def correctness(results: list[SystemData], greedy: bool) -> dict | None:
    """Token agreement of each system's first run with the reference system's (greedy runs only)."""
    if not greedy or len(results) < 2:
        return None
    ref = next((r for r in results if r.name == OVERLAP), results[0])
    out = {"reference": ref.name, "results": {}}
    for r in results:
        if r is ref or r.first_tokens is None or ref.first_tokens is None:
            continue
        pairs = list(zip(ref.first_tokens, r.first_tokens))
        prefixes = [_common_prefix(a, b) / max(len(a), 1) for a, b in pairs]
        out["results"][r.name] = {"compared": len(pairs), "identical": sum(a == b for a, b in pairs),
                                  "mean_common_prefix_fraction": float(np.mean(prefixes)) if prefixes else 1.0}
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
