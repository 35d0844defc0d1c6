"""Every number reported for one offline run, and medians over its repeats (definitions:
``asyncbatch.bench.metrics``)."""

from __future__ import annotations

from asyncbatch.bench.metrics import distribution, spread
from harness.records import RunResult

# Engine counters copied from ``LLM.stats()`` into every asyncbatch run.
ENGINE_KEYS = ("device_busy_fraction", "idle_gap_ms_mean", "idle_gap_ms_p99", "planner_ms_per_step",
               "device_ms_per_step", "tokens_per_step", "steps", "preemptions", "prefix_cache_hit_rate")
DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SCALARS = ("duration_s", "request_throughput", "output_throughput", "total_token_throughput",
           "computed_token_throughput", "peak_memory_mib", "cpu_s", "output_tokens_per_cpu_s", "contention")


def run_metrics(run: RunResult) -> dict:
    """Every number reported for one run."""
    reqs = run.requests
    duration = max(run.duration, 1e-9)
    out_tokens = sum(r.output_len for r in reqs)
    prompt_tokens = sum(r.prompt_len for r in reqs)
    itls = [g for r in reqs for g in r.itls()]
    has_chunks = any(r.chunk_times is not None for r in reqs)
    engine = None
    if run.engine_stats is not None:
        engine = {k: float(run.engine_stats[k]) for k in ENGINE_KEYS if k in run.engine_stats}
    return {
        "num_requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "computed_tokens": run.computed_tokens,
        "duration_s": duration,
        "request_throughput": len(reqs) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "computed_token_throughput": None if run.computed_tokens is None else run.computed_tokens / duration,
        "cpu_s": run.cpu_s,
        "output_tokens_per_cpu_s": out_tokens / run.cpu_s if run.cpu_s else None,
        "host": dict(run.host),
        "contention": run.host.get("contention"),
        "ttft_ms": distribution(r.ttft for r in reqs),
        "tpot_ms": distribution(r.tpot for r in reqs),
        "itl_ms": distribution(itls) if has_chunks else None,
        "e2e_ms": distribution(r.latency for r in reqs),
        "engine": engine,
        "memory": dict(run.memory),
        "peak_memory_mib": run.memory.get("peak_mib"),
    }


def summarize_runs(metrics: list[dict]) -> dict:
    """Medians and spreads over repeats of the same system and request rate.

    Scalars get ``spread``; each distribution statistic (e.g. ``ttft_ms.p99``)
    gets the spread of its per-run values; engine counters likewise.
    """
    summary: dict = {k: spread([m.get(k) for m in metrics]) for k in SCALARS}
    for name in DISTRIBUTIONS:
        runs = [m[name] for m in metrics if m.get(name) is not None]
        summary[name] = None if not runs else {stat: spread([r[stat] for r in runs]) for stat in runs[0]}
    engines = [m["engine"] for m in metrics if m.get("engine")]
    summary["engine"] = None if not engines else {k: spread([e.get(k) for e in engines]) for k in engines[0]}
    return summary
