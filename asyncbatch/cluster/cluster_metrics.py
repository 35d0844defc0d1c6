"""The ingress's engine series for ``/metrics``: one per replica (a ``replica`` label), plus the router's
decisions and the ingress's own queue.

Same names as one engine's server (``serve.metrics``), so a dashboard built for one engine works on a
cluster with ``sum by (model_name)`` or per ``replica``:

    asyncbatch:num_requests_running{model_name, replica}      asyncbatch:prefix_cache_queries_total{...}
    asyncbatch:num_requests_waiting{model_name, replica}      asyncbatch:prefix_cache_hits_total{...}
    asyncbatch:kv_cache_usage_perc{model_name, replica}       asyncbatch:prefix_cache_hit_rate{...}
    asyncbatch:device_busy_fraction{model_name, replica}      asyncbatch:prefix_cache_blocks{...}
    asyncbatch:device_busy_seconds_total{...}                 asyncbatch:device_span_seconds_total{...}
    asyncbatch:router_decisions_total{model_name, reason="cache_hit"|"load"}   (cache-aware router only)
    asyncbatch:ingress_requests_in_flight{model_name}         asyncbatch:ingress_requests_waiting{model_name}
    asyncbatch:num_replicas{model_name}                       (replicas reporting)

Read at scrape time from the routers of this process (``router_registry``), which hold each replica's
newest ``ReplicaMetrics`` (at most about ``stats_period_s`` old). The cluster-wide hit rate is
``sum(rate(hits)) / sum(rate(queries))``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from asyncbatch.cluster import router_registry
from asyncbatch.cluster.replica_metrics import ReplicaMetrics

_GAUGES = (  # (name, help, value)
    ("asyncbatch:num_requests_running", "Requests in the replica's running batch.", lambda m: m.num_running),
    ("asyncbatch:num_requests_waiting", "Requests waiting to be scheduled on the replica.", lambda m: m.num_waiting),
    ("asyncbatch:kv_cache_usage_perc", "Fraction of the replica's KV blocks in use (1 = full).", lambda m: m.kv_usage),
    ("asyncbatch:device_busy_fraction", "The replica's device busy fraction over its last 1000 steps.",
     lambda m: m.busy_fraction),
    ("asyncbatch:prefix_cache_hit_rate", "The replica's prefix cache hits / queries.", lambda m: m.hit_rate),
    ("asyncbatch:prefix_cache_blocks", "KV blocks holding cached prefixes on the replica.",
     lambda m: m.prefix_blocks),
)
_COUNTERS = (
    ("asyncbatch:prefix_cache_queries", "Prompt tokens looked up in the replica's prefix cache.",
     lambda m: m.prefix_queries),
    ("asyncbatch:prefix_cache_hits", "Of those, tokens reused instead of computed.", lambda m: m.prefix_hits),
    ("asyncbatch:device_busy_seconds", "The replica's device time spent in steps.", lambda m: m.busy_s),
    ("asyncbatch:device_span_seconds", "Wall time while the replica had work (busy plus host-caused gaps).",
     lambda m: m.span_s),
)


def replica_metrics() -> list[ReplicaMetrics]:
    """Every replica's newest metrics, by label (the replicas this process's routers know)."""
    found = (ReplicaMetrics.from_stats(stats) for stats in router_registry.replica_stats().values())
    return sorted((m for m in found if m is not None), key=lambda m: m.replica)


class ClusterCollector(Collector):
    """Collects the series in the module docstring; ``num_requests`` is the ingress's (in flight, waiting)."""

    def __init__(self, model_name: str, num_requests: Callable[[], tuple[int, int]]) -> None:
        self._model = model_name
        self._num_requests = num_requests

    def collect(self) -> Iterator:
        replicas = replica_metrics()
        labels = ["model_name", "replica"]
        for name, doc, value in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for m in replicas:
                family.add_metric([self._model, m.replica], float(value(m)))
            yield family
        for name, doc, value in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            for m in replicas:
                family.add_metric([self._model, m.replica], float(value(m)))
            yield family
        yield self._gauge("asyncbatch:num_replicas", "Replicas reporting metrics.", len(replicas))
        in_flight, waiting = self._num_requests()
        yield self._gauge("asyncbatch:ingress_requests_in_flight", "Requests this ingress sent that are not "
                          "finished.", in_flight)
        yield self._gauge("asyncbatch:ingress_requests_waiting", "Of those, requests without a token yet (queued "
                          "in the router or a replica; what --max-waiting bounds).", waiting)
        if any(hasattr(r, "decisions") for r in router_registry.routers()):
            decisions = router_registry.decisions()
            family = CounterMetricFamily("asyncbatch:router_decisions", "Requests routed, by reason: cache_hit "
                                         "(to a replica caching part of the prompt) or load (least loaded).",
                                         labels=["model_name", "reason"])
            for reason in (router_registry.CACHE_HIT, router_registry.LOAD):
                family.add_metric([self._model, reason], float(decisions[reason]))
            yield family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model], float(value))
        return family
