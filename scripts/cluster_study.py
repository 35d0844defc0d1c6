"""Cluster traffic study on ``sim`` replicas: routers side by side on one multi-tenant bursty load.

    .venv/bin/python scripts/cluster_study.py --out profiles/cluster-sim

For each router (cache-aware, Ray Serve's power of two choices, Ray's PrefixCacheAffinityRouter) it deploys
``--replicas`` sim engines on one local Ray, replays the same requests (``--tenants`` tenants, each with its own
``--system-tokens``-token system prompt, gamma arrivals of ``--burstiness`` at ``--rate`` req/s) through a
deployment handle whose router is the one under test, and reads the replicas' own counters afterwards
(prefix-cache hit rate, requests served, device busy intervals). Writes ``results.json``, ``summary.csv`` and
``device_busy.png`` to ``--out``. Every figure is simulated (the ``sim`` device's cost model).

The KV cache of a replica (``--kv-blocks``) holds only part of the tenants' prompts, so which replica a request
lands on decides whether its prompt is cached: that is the effect under study.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import sys
import time
from pathlib import Path

import numpy as np
import ray
from ray import serve

from asyncbatch.bench.arrivals import arrival_offsets
from asyncbatch.bench.report import write_json
from asyncbatch.cluster import launch
from asyncbatch.cluster.request import ReplicaRequest
from asyncbatch.config import SimConfig
from asyncbatch.profiling.host_info import cpu_name
from asyncbatch.sampling_params import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 100, 40000  # token ids of the synthetic prompts (inside SmolLM2's vocabulary)


def workload(args) -> list[tuple[float, int, list[int]]]:
    """(arrival offset s, tenant, prompt ids) per request: tenant system prompt + a fresh user part."""
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(VOCAB_LOW, VOCAB_HIGH, args.system_tokens).tolist() for _ in range(args.tenants)]
    offsets = arrival_offsets(args.requests, args.rate, args.burstiness, seed=args.seed)
    tenants = rng.integers(0, args.tenants, args.requests)
    return [(t, int(k), systems[k] + rng.integers(VOCAB_LOW, VOCAB_HIGH, args.user_tokens).tolist())
            for t, k in zip(offsets, tenants)]


async def replay(handle, requests, max_tokens: int) -> tuple[list[dict], float]:
    stream = handle.options(stream=True)
    t0 = time.perf_counter()

    async def one(i: int, offset: float, tenant: int, ids: list[int]) -> dict:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        sent = time.perf_counter()
        first = None
        tokens = 0
        error = None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)
        try:
            async for delta in stream.generate.remote(ReplicaRequest(ids, params, f"req-{i}")):
                if delta.token_ids and first is None:
                    first = time.perf_counter()
                tokens += len(delta.token_ids)
        except Exception as exc:  # noqa: BLE001 - counted as a failure in the results
            error = f"{type(exc).__name__}: {exc}"[:200]
        end = time.perf_counter()
        return {"i": i, "tenant": tenant, "sent": sent - t0, "ttft": None if first is None else first - sent,
                "latency": end - sent, "tokens": tokens, "error": error}

    return list(await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))), t0


def replica_stats(handle, num_replicas: int) -> list[dict]:
    """Every replica's ``stats`` (calls without a prompt reach replicas at random; ask until all answered)."""
    seen: dict[int, dict] = {}
    for _ in range(30 * num_replicas):
        s = handle.stats.remote().result(timeout_s=30)
        seen[s["pid"]] = s
        if len(seen) == num_replicas:
            break
    return list(seen.values())


def busy_series(stats: list[dict], t0: float, span: float, bin_s: float) -> list[float]:
    """The cluster's device busy fraction per ``bin_s`` bin (mean over replicas)."""
    nbins = int(np.ceil(span / bin_s))
    busy = np.zeros(nbins)
    for s in stats:
        for start, end in s["busy_intervals"]:
            a, b = start - t0, end - t0
            for k in range(max(0, int(a // bin_s)), min(nbins, int(b // bin_s) + 1)):
                lo, hi = k * bin_s, (k + 1) * bin_s
                busy[k] += max(0.0, min(b, hi) - max(a, lo))
    return (busy / (bin_s * len(stats))).tolist()


def summarize(router: str, results: list[dict], stats: list[dict], t0: float, bin_s: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = np.array([r["ttft"] for r in ok if r["ttft"] is not None])
    span = max(r["sent"] + r["latency"] for r in results)
    prompt = sum(s["prefix"]["prompt_tokens"] for s in stats)
    cached = sum(s["prefix"]["cached_tokens"] for s in stats)
    served = [s["served"] for s in stats]
    per_busy = [sum(e - b for b, e in s["busy_intervals"]) / span for s in stats]
    return {"router": router, "requests": len(results), "failed": len(results) - len(ok), "span_s": span,
            "throughput_rps": len(ok) / span, "output_tok_s": sum(r["tokens"] for r in ok) / span,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
            "ttft_mean_ms": 1e3 * float(ttft.mean()), "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "served_per_replica": served, "load_spread": (max(served) - min(served)) / np.mean(served),
            "device_busy_per_replica": per_busy, "cluster_device_busy": float(np.mean(per_busy)),
            "evictions": sum(s["prefix"]["evictions"] for s in stats),
            "busy_over_time": busy_series(stats, t0, span, bin_s), "bin_s": bin_s,
            "ttft_p90_ms": 1e3 * float(np.percentile(ttft, 90)), "ttft_p95_ms": 1e3 * float(np.percentile(ttft, 95)),
            "per_request": [{k: r[k] for k in ("tenant", "sent", "ttft", "latency", "error")} for r in results]}


def run_router(router: str, args, engine: dict, requests) -> dict:
    spec = launch.ClusterSpec(num_replicas=args.replicas, router=router, stats_period_s=args.stats_period,
                              max_age_s=4 * args.stats_period, replica_num_cpus=0.5)
    app = f"study-{router}"
    deployment = launch.replica_deployment(spec, None, engine, name=f"EngineReplica-{router}")
    t = time.perf_counter()
    handle = serve.run(deployment, name=app, route_prefix=None)
    print(f"[{router}] {args.replicas} replicas up in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    try:
        time.sleep(2 * args.stats_period)  # the first summaries reach the router
        results, t0 = asyncio.run(replay(handle, requests, args.max_tokens))
        time.sleep(0.5)
        stats = replica_stats(handle, args.replicas)
        summary = summarize(router, results, stats, t0, args.bin_s)
        print(f"[{router}] " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in summary.items() if k not in ("busy_over_time", "per_request")),
              file=sys.stderr)
        return summary
    finally:
        serve.delete(app)


def plot(summaries: list[dict], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for s in summaries:
        xs = np.arange(len(s["busy_over_time"])) * s["bin_s"]
        ax.plot(xs, s["busy_over_time"], label=f"{s['router']} (mean {s['cluster_device_busy']:.0%})")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("cluster device busy (mean of replicas)")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right")
    ax.set_title("Device busy over time, simulated\n" + subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profiles/cluster-sim"))
    p.add_argument("--routers", default="cache-aware,pow2,ray-prefix")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--tenants", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--rate", type=float, default=12.0, help="requests per second, whole cluster")
    p.add_argument("--burstiness", type=float, default=0.5, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--kv-blocks", type=int, default=768, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--step-ms", type=float, default=8.0)
    p.add_argument("--per-token-us", type=float, default=200.0, help="sim: prefill cost per computed token")
    p.add_argument("--per-context-ns", type=float, default=5.0)
    p.add_argument("--stats-period", type=float, default=0.5)
    p.add_argument("--bin-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    routers = args.routers.split(",")
    for r in routers:
        if r not in launch.ROUTERS:
            raise SystemExit(f"--routers: each must be one of {launch.ROUTERS}, got {r!r}")
    sim = SimConfig(step_fixed_ms=args.step_ms, per_token_us=args.per_token_us,
                    per_context_token_ns=args.per_context_ns)
    engine = {"device": "sim", "sim": sim, "num_kv_blocks": args.kv_blocks, "max_model_len": 2048,
              "max_num_seqs": 64, "seed": args.seed}
    requests = workload(args)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas + 1), include_dashboard=False, log_to_driver=False)
    summaries = []
    loads = []
    try:
        serve.start(proxy_location="Disabled")
        for router in routers:
            summaries.append(run_router(router, args, engine, requests))
            loads.append(os.getloadavg())
    finally:
        serve.shutdown()
        ray.shutdown()
    machine = f"{cpu_name()}, {os.cpu_count()} cores"
    doc = {"simulated": True, "command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
           "machine": machine, "loadavg_before": load_before, "loadavg_after_each": loads,
           "prefix_blocks_per_tenant": args.system_tokens // 16,
           "tenant_blocks_total": args.tenants * (args.system_tokens // 16), "summaries": summaries}
    write_json(doc, args.out / "results.json", nan_as_null=True)
    keys = ["router", "requests", "failed", "throughput_rps", "output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
            "prefix_hit_rate", "served_per_replica", "load_spread", "cluster_device_busy", "evictions"]
    with open(args.out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for s in summaries:
            w.writerow([s[k] for k in keys])
    plot(summaries, args.out / "device_busy.png",
         f"{args.replicas} sim replicas, {args.tenants} tenants x {args.system_tokens}-token system prompts, "
         f"{args.rate:g} req/s gamma({args.burstiness:g}), {args.kv_blocks} KV blocks/replica")
    return 0


if __name__ == "__main__":
    sys.exit(main())
