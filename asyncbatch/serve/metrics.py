"""``GET /metrics``: Prometheus text, named like vLLM's metrics with the ``asyncbatch:`` prefix.

Per-request figures (TTFT, TPOT, ITL, end-to-end latency, tokens, finish
reasons) are observed by the server as requests finish. Engine figures come
from the step timeline at scrape time: running and waiting requests and KV use
from the newest step; device busy as cumulative counters (rate them: busy
fraction over an interval = Δ``device_busy_seconds_total`` / Δ``device_span_seconds_total``,
idle-for-lack-of-work gaps excluded) and as a gauge over the last
``RECENT_STEPS`` steps, with the mean idle gap between those steps. Prefix-cache
figures appear when the engine reports them. Each server owns its registry, so
several can run in one process (tests). A server in front of several engines (the
cluster's ingress) passes its own ``engine_collector`` instead (per-replica series).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from asyncbatch.outputs import RequestOutput
from asyncbatch.profiling.timeline import Timeline, summarize

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RECENT_STEPS = 1000
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                  0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    """Reads the engine's state when scraped (nothing is computed between scrapes)."""

    def __init__(self, timeline: Timeline, model_name: str, num_requests: Callable[[], tuple[int, int]],
                 prefix_stats: Callable[[], dict | None]) -> None:
        self._timeline = timeline
        self._labels = {"model_name": model_name}
        self._num_requests = num_requests
        self._prefix_stats = prefix_stats

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self) -> Iterator:
        recent = self._timeline.recent(RECENT_STEPS)
        newest = recent[-1] if recent else None
        unfinished, unscheduled = self._num_requests()
        running = newest.num_running if newest is not None else 0
        # The newest step may predate requests that arrived since; the frontend's own count covers them.
        waiting = max(newest.num_waiting if newest is not None else 0, unscheduled)
        yield self._gauge("asyncbatch:num_requests_running", "Requests in the running batch (newest step).",
                          running if unfinished else 0)
        yield self._gauge("asyncbatch:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        usage = newest.kv_blocks_used / newest.kv_blocks_usable if newest and newest.kv_blocks_usable else 0.0
        yield self._gauge("asyncbatch:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full; newest step).",
                          usage if unfinished else 0.0)
        summary = summarize(recent)
        yield self._gauge("asyncbatch:device_busy_fraction",
                          f"Device busy fraction over the last {RECENT_STEPS} steps.", summary["device_busy_fraction"])
        yield self._gauge("asyncbatch:device_idle_gap_seconds",
                          f"Mean idle gap between consecutive steps over the last {RECENT_STEPS} steps.",
                          summary["idle_gap_ms_mean"] / 1e3)
        yield self._counter("asyncbatch:device_busy_seconds", "Device time spent in steps.",
                            self._timeline.busy_s_total)
        yield self._counter("asyncbatch:device_span_seconds",
                            "Wall time while the engine had work (busy plus host-caused gaps).",
                            self._timeline.span_s_total)
        yield self._counter("asyncbatch:steps", "Steps executed.", float(newest.step_id if newest else 0))
        drafts, draft_tokens, accepted = self._timeline.spec_totals
        if draft_tokens:  # vLLM's speculative decoding counters (docs/speculative.md)
            yield self._counter("asyncbatch:spec_decode_num_drafts", "Rows that verified drafts, per step.",
                                float(drafts))
            yield self._counter("asyncbatch:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                float(draft_tokens))
            yield self._counter("asyncbatch:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                float(accepted))
        stats = self._prefix_stats()
        if stats and stats.get("enabled"):
            yield self._counter("asyncbatch:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                "at admissions (since start or reset_prefix_cache).", float(stats["prompt_tokens"]))
            yield self._counter("asyncbatch:prefix_cache_hits", "Of those, tokens reused instead of computed.",
                                float(stats["cached_tokens"]))
            yield self._gauge("asyncbatch:prefix_cache_hit_rate", "Prefix cache hits / queries.",
                              float(stats["hit_rate"]))
            yield self._gauge("asyncbatch:prefix_cache_blocks", "KV blocks holding cached prefixes.",
                              float(stats["cached_blocks"]))


class ServeMetrics:
    """The server's metrics registry: request histograms and counters, plus the engine collector."""

    def __init__(self, model_name: str, timeline: Timeline, num_requests: Callable[[], tuple[int, int]],
                 prefix_stats: Callable[[], dict | None], engine_collector: Collector | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        r = self.registry
        self.ttft = Histogram("asyncbatch:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("asyncbatch:time_per_output_token_seconds", "Mean time per output token after "
                              "the first, per request.", labels, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("asyncbatch:inter_token_latency_seconds", "Time between consecutive streamed "
                             "chunks (per token for one-token chunks).", labels, buckets=_TOKEN_BUCKETS,
                             registry=r).labels(model_name)
        self.e2e = Histogram("asyncbatch:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("asyncbatch:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("asyncbatch:generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=r).labels(model_name)
        self._success = Counter("asyncbatch:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._rejected = Counter("asyncbatch:requests_rejected", "Requests refused before reaching the engine "
                                 "(every 4xx and 503 answer), by HTTP status.", ["model_name", "status"], registry=r)
        r.register(engine_collector or _EngineCollector(timeline, model_name, num_requests, prefix_stats))

    def observe(self, output: RequestOutput) -> None:
        """A finished request (one choice)."""
        metrics = output.metrics
        self._success.labels(self._model, output.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        n = len(output.token_ids)
        self.generation_tokens.inc(n)
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        if metrics.latency is not None:
            self.e2e.observe(metrics.latency)
            if n > 1 and metrics.ttft is not None:
                self.tpot.observe((metrics.latency - metrics.ttft) / (n - 1))

    def rejected(self, status: int) -> None:
        self._rejected.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
