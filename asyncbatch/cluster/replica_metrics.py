"""What one replica reports for the ingress's ``/metrics``, riding along with its routing stats.

A replica's ``record_routing_stats`` (``deployment``) returns its ``CacheSummary`` for routing plus, under
``"metrics"``, a ``ReplicaMetrics``: its load, KV use, device busy and prefix-cache counters, read from its
own engine when Ray Serve collects the stats (every ``stats_period_s``). Ray hands the stats to every router
of the deployment (``RunningReplica.routing_stats``), so the ingress, which holds the router, sees every
replica's figures without a call per scrape; they are at most about ``stats_period_s`` old.

``replica`` is the replica's rank in the deployment (``serve.get_replica_context().rank``: ``"0"`` to
``"N-1"``; a restarted replica takes the rank its predecessor freed), so a dashboard's series keep their
label across restarts. Counters (``prefix_*``, ``busy_s``, ``span_s``) restart from 0 with the replica, as
a Prometheus counter reset.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

STATS_KEY = "metrics"  # where a replica's routing stats dict carries its ReplicaMetrics


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    replica: str  # stable label: the rank in the deployment (see the module docstring)
    num_running: int
    num_waiting: int
    kv_usage: float  # KV blocks in use / usable, newest step, in [0, 1]
    busy_fraction: float  # device busy over the replica's last RECENT_STEPS steps
    busy_s: float  # device time in steps since the replica started (counter)
    span_s: float  # wall time while it had work (counter)
    prefix_queries: int  # prompt tokens looked up in its prefix cache (counter)
    prefix_hits: int  # of those, tokens reused (counter)
    prefix_blocks: int  # KV blocks holding cached prefixes now
    timestamp: float  # time.time() on the replica

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def to_stats(self) -> dict:
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: dict | None) -> ReplicaMetrics | None:
        """The metrics in a replica's routing stats; None if it published none (yet, or an older replica)."""
        raw = (stats or {}).get(STATS_KEY)
        if not raw:
            return None
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})
