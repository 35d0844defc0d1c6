"""What the benchmark numbers mean, and the statistics every report takes: latency distributions,
spreads over repeats. (An offline run's numbers: ``scripts/harness/run_metrics.py``.)

Definitions (vLLM's ``benchmark_serving`` conventions):
- TTFT: submission to the first output token reaching the caller.
- TPOT, per request: (latency - TTFT) / (output tokens - 1); requests with one
  output token have none.
- ITL: gaps between consecutive deliveries to a streaming caller, pooled over
  all requests.
- E2E: submission to the last output token.
- Throughputs divide by the run's wall time (first submission to last output).
- Output tokens per CPU-second divide by this process's CPU time (all threads)
  in the same window: on a shared machine it moves less with other people's
  jobs than wall-clock throughput does, so it is reported beside it, together
  with ``contention``, the share of the CPUs other processes took meanwhile.

Distributions are summarised as mean, P50, P90 and P99 in milliseconds; a
metric the system could not measure is ``None`` (never a made-up zero).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def distribution(values_s: Iterable[float | None]) -> dict | None:
    """mean/p50/p90/p99 in ms of the non-None values (seconds in), or None if there are none."""
    v = np.array([x for x in values_s if x is not None], dtype=np.float64) * 1e3
    if v.size == 0:
        return None
    out = {"mean": float(v.mean())}
    out.update({f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES})
    return out


def spread(values: Sequence[float | None]) -> dict | None:
    """Median, min, max and relative spread ((max - min) / median) of repeated measurements."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return None
    med = statistics.median(v)
    return {"median": med, "min": min(v), "max": max(v), "rel_spread": (max(v) - min(v)) / med if med else 0.0,
            "n": len(v)}


def median_of(summary: dict, *path: str) -> float | None:
    """``summary[path...]["median"]``, or None anywhere along the way."""
    node: object = summary
    for key in path:
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return node.get("median") if isinstance(node, dict) else None
