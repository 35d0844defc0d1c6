"""What the server says about itself during a load point: its Prometheus ``/metrics``, before, during, after.

asyncbatch serve exports vLLM's metric names under the ``asyncbatch:`` prefix. Device busy over a
load point is ``delta device_busy_seconds_total / delta device_span_seconds_total`` between a scrape
just before the first request and one just after the last; a sampler polls the gauges (running and
waiting requests, KV-cache use) meanwhile, which shows whether the load saturated the batch. Token
counters give the server's own count of the tokens the client counted.

A server without ``/metrics`` (transformers serve) or without these names gets ``None`` and a note
instead of numbers; nothing here fails a benchmark.
"""

from __future__ import annotations

import threading
import time

import httpx

PREFIX = "asyncbatch:"
BUSY, SPAN = "device_busy_seconds_total", "device_span_seconds_total"
COUNTERS = {"prompt_tokens": "prompt_tokens_total", "generation_tokens": "generation_tokens_total"}
GAUGES = {"running": "num_requests_running", "waiting": "num_requests_waiting",
          "kv_cache_usage": "kv_cache_usage_perc", "device_busy_recent": "device_busy_fraction"}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (right for the counters and gauges of one served
    model; meaningless for histogram ``_bucket`` series, which nothing here reads)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        values[name.strip()] = values.get(name.strip(), 0.0) + value
    return values


def scrape(client: httpx.Client) -> tuple[dict[str, float] | None, str | None]:
    """(metrics, None), or (None, why not)."""
    try:
        response = client.get("/metrics")
    except httpx.HTTPError as exc:
        return None, f"GET /metrics failed: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return None, f"GET /metrics answered HTTP {response.status_code}"
    return parse_prometheus(response.text), None


class GaugeSampler:
    """Polls ``/metrics`` every ``interval_s`` from a thread of its own while a load point runs, and keeps
    the gauges' samples. A thread, not a task on the client's event loop: with a thousand streams in
    flight that loop falls behind, and a task on it would sample seconds apart."""

    def __init__(self, base_url: str, interval_s: float = 1.0) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = {k: [] for k in GAUGES}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-metrics-sampler", daemon=True)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30.0, trust_env=False) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                values, _ = scrape(client)
                for key, name in GAUGES.items():
                    if values is not None and PREFIX + name in values:
                        self.samples[key].append(values[PREFIX + name])
                self._stop.wait(max(self.interval_s - (time.perf_counter() - started), 0.0))

    def __enter__(self) -> GaugeSampler:  # noqa: PYI034 - not meant to be subclassed
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def summary(self) -> dict:
        out: dict = {"samples": max((len(v) for v in self.samples.values()), default=0),
                     "interval_s": self.interval_s}
        for key, values in self.samples.items():
            out[key] = None if not values else {"max": max(values), "mean": sum(values) / len(values)}
        return out


def window(before: dict[str, float] | None, after: dict[str, float] | None, sampler: GaugeSampler | None,
           note: str | None) -> dict:
    """The server's figures over a load point: device busy from the counters' deltas, token deltas,
    and the sampled gauges; ``available`` False (with ``note``) where the server exports none."""
    if before is None or after is None or PREFIX + BUSY not in after or PREFIX + SPAN not in after:
        why = note or f"the server's /metrics has no {PREFIX}{BUSY} / {PREFIX}{SPAN} (not asyncbatch serve?)"
        return {"available": False, "note": why}
    busy = after[PREFIX + BUSY] - before.get(PREFIX + BUSY, 0.0)
    span = after[PREFIX + SPAN] - before.get(PREFIX + SPAN, 0.0)
    out: dict = {"available": True, "note": note, "device_busy_s": busy, "device_span_s": span,
                 "device_busy_fraction": busy / span if span > 0 else None}
    for key, name in COUNTERS.items():
        full = PREFIX + name
        out[key] = after[full] - before.get(full, 0.0) if full in after else None
    out["gauges"] = None if sampler is None else sampler.summary()
    return out
