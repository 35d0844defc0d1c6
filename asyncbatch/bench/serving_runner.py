"""One server through every load point: warm-up, then per point the replay, the server's metrics, a summary.

Order (one server at a time, so systems never share the machine with each other)::

    server up ──► warm-up requests ──► point 1 ──► point 2 ──► ... ──► server down
                                       │
                                       scrape /metrics ─► [sampler thread polls gauges │ replay] ─► scrape

Every point gets its own slice of the workload (``point_requests``): no prompt reaches a server
twice, so a prefix cache cannot turn a later point into a cache hit; every system gets the same
slices in the same order at the same arrival offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from dataclasses import dataclass

import httpx

from asyncbatch.bench.arrivals import arrival_offsets
from asyncbatch.bench.host_load import ServerLoad
from asyncbatch.bench.serving_client import ClientOptions, Dialect, LoadRun, ServingRequest, replay
from asyncbatch.bench.serving_metrics import SLO, summarize
from asyncbatch.bench.serving_prometheus import GaugeSampler, scrape, window

WARMUP_MAX_TOKENS = 8


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """Offered load: a request rate (inf: all at once), optionally capped at ``max_concurrency`` in flight."""

    request_rate: float
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        cap = "" if self.max_concurrency is None else f", <= {self.max_concurrency} in flight"
        return f"{rate} req/s{cap}"

    def as_dict(self) -> dict:
        return {"request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
                "max_concurrency": self.max_concurrency, "label": self.label}


def load_points(rates: list[float], concurrencies: list[int | None]) -> list[LoadPoint]:
    """Every rate with every concurrency cap, rates outermost."""
    return [LoadPoint(rate, cap) for rate in rates for cap in concurrencies]


@dataclass(frozen=True, slots=True)
class RunPlan:
    """What every system runs: the same requests per point, arrivals and options."""

    points: list[LoadPoint]
    requests: list[list[ServingRequest]]  # one slice per point
    warmup: list[ServingRequest]
    options: ClientOptions
    slo: SLO
    burstiness: float = 1.0
    seed: int = 0
    sample_interval_s: float = 1.0


def point_requests(requests: list[ServingRequest], n: int, num_points: int) -> tuple[list[list[ServingRequest]],
                                                                                      list[ServingRequest]]:
    """Split ``num_points * n`` requests (and a remainder for the warm-up) into one slice per point."""
    if len(requests) < n * num_points:
        raise ValueError(f"need {n * num_points} requests for {num_points} points of {n}, got {len(requests)}")
    slices = [requests[i * n:(i + 1) * n] for i in range(num_points)]
    return slices, requests[n * num_points:]


def warmup_requests(requests: list[ServingRequest], count: int) -> list[ServingRequest]:
    """``count`` requests with outputs capped at ``WARMUP_MAX_TOKENS``: every code path once, quickly."""
    return [ServingRequest(r.prompt, min(r.max_tokens, WARMUP_MAX_TOKENS), r.prompt_len) for r in requests[:count]]


def _measure(base_url: str, model: str, requests: list[ServingRequest], offsets: list[float], dialect: Dialect,
             plan: RunPlan, cap: int | None, pgid: int | None) -> tuple[LoadRun, dict, dict]:
    """The replay, bracketed by /metrics scrapes and CPU accounting, with the gauges sampled meanwhile."""
    with httpx.Client(base_url=base_url, timeout=30.0, trust_env=False) as metrics_client:
        before, note = scrape(metrics_client)
        sampler = GaugeSampler(base_url, plan.sample_interval_s) if before is not None else None
        with contextlib.ExitStack() as stack:
            if sampler is not None:
                stack.enter_context(sampler)
            with ServerLoad(pgid) as load:
                run = asyncio.run(replay(base_url, model, requests, offsets, dialect, plan.options, cap))
        after, after_note = scrape(metrics_client) if before is not None else (None, None)
    return run, window(before, after, sampler, note or after_note), load.result()


def run_point(base_url: str, model: str, dialect: Dialect, plan: RunPlan, index: int,
              server_pgid: int | None = None) -> dict:
    """One load point; ``server_pgid``: the server's process group, whose CPU time ``host`` reports."""
    point = plan.points[index]
    requests = plan.requests[index]
    offsets = arrival_offsets(len(requests), point.request_rate, plan.burstiness, plan.seed + index)
    run, server, host = _measure(base_url, model, requests, offsets, dialect, plan, point.max_concurrency,
                                 server_pgid)
    summary = summarize(run, plan.slo)
    cpu = host["server_cpu_s"]
    host["output_tokens_per_server_cpu_s"] = summary["output_tokens"] / cpu if cpu else None
    return {"load": point.as_dict(), "summary": summary, "server": server, "host": host,
            "requests": [r.as_dict() for r in run.results]}


def warm_up(base_url: str, model: str, dialect: Dialect, plan: RunPlan) -> dict | None:
    """Send the warm-up requests all at once; their summary (failures included) goes into the report."""
    if not plan.warmup:
        return None
    offsets = [0.0] * len(plan.warmup)
    run = asyncio.run(replay(base_url, model, plan.warmup, offsets, dialect, plan.options))
    summary = summarize(run, SLO())
    return {k: summary[k] for k in ("num_requests", "completed", "failed", "failure_reasons", "duration_s")}


def run_system(entry: dict, base_url: str, model: str, dialect: Dialect, plan: RunPlan, log=print,
               server_pgid: int | None = None) -> None:
    """Warm-up and every load point against one running server, into ``entry["warmup"]`` and
    ``entry["points"]`` as each finishes (an interrupted run keeps the points it completed)."""
    name = entry["name"]
    warm = entry["warmup"] = warm_up(base_url, model, dialect, plan)
    if warm is not None:
        log(f"  {name}: warm-up {warm['completed']}/{warm['num_requests']} ok in {warm['duration_s']:.1f} s")
        if warm["failed"]:
            log(f"  {name}: warm-up failures: {warm['failure_reasons']}")
    for i, point in enumerate(plan.points):
        result = run_point(base_url, model, dialect, plan, i, server_pgid)
        entry["points"].append(result)
        log("  " + progress_line(name, point, result))


def progress_line(name: str, point: LoadPoint, result: dict) -> str:
    s, server = result["summary"], result["server"]
    ttft, tpot = s["ttft_ms"] or {}, s["tpot_ms"] or {}
    busy = server.get("device_busy_fraction") if server.get("available") else None
    running = ((server.get("gauges") or {}).get("running") or {}).get("max") if server.get("available") else None
    extra = "" if busy is None else f", device busy {100 * busy:.1f}%"
    extra += "" if running is None else f", max running {running:.0f}"
    contention = result["host"]["contention"]
    extra += "" if contention is None else f", others took {100 * contention:.0f}% of the CPUs"
    return (f"{name:<13} {point.label:<24} {s['completed']}/{s['num_requests']} ok, "
            f"{s['output_throughput']:8.1f} out tok/s, TTFT p99 {ttft.get('p99', math.nan):8.1f} ms, "
            f"TPOT p99 {tpot.get('p99', math.nan):7.1f} ms, {s['duration_s']:6.1f} s{extra}")


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
