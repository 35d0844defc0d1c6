"""``CacheAwareRouter``: a Ray Serve request router that sends each request where its prefix is cached.

Ray Serve runs one router per deployment handle (in the ingress replica, or in a driver holding a handle).
For every request it calls ``choose_replicas(candidates, pending_request)``; this one returns the candidates in
``CacheAwarePolicy`` order, one replica per rank, so Ray tries the best first and falls back to the next when a
replica's queue is full (``max_ongoing_requests``) or it died.

    replica ──record_routing_stats (every period_s)──► controller ──long poll──► RunningReplica.routing_stats
    router: prompt ids ─chain keys─► match vs (summary keys if age <= max_age_s) ∪ (keys it routed there < ttl)
            load = max(requests this router has in flight or just chose there, running + waiting in the fresh summary)

Decisions are counted by reason (``router_registry.CACHE_HIT``: it went to a replica holding at least
``min_match_blocks`` of its prompt; ``LOAD``: otherwise), read by the ingress's ``/metrics``.

Staleness: a summary older than ``max_age_s`` contributes no keys (its blocks may have been evicted since);
the keys this router itself just sent somewhere count for ``recent_ttl_s`` (the replica caches them within a
step, and its next summary confirms them). Load from this router's own in-flight count is exact at once.

Bursts: Ray Serve chooses replicas for several pending requests before the first of them is routed (and
counted in flight). A choice therefore counts on its first-ranked replica at once (``_choosing``) until the
request is routed, wherever it went; otherwise every request of a burst sees the same loads and the same
ranking, and the whole burst lands on one replica.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, defaultdict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from asyncbatch.cluster.cache_summary import CacheSummary, prompt_keys
from asyncbatch.cluster.request import ReplicaRequest
from asyncbatch.cluster.router_registry import CACHE_HIT, LOAD, RegisteredRouter
from asyncbatch.cluster.routing_policy import CacheAwarePolicy, Either, RecentRoutes, ReplicaView

log = logging.getLogger("asyncbatch.cluster")

_MAX_PENDING = 65536


def _request_of(pending: PendingRequest | None) -> ReplicaRequest | None:
    if pending is None:
        return None
    return next((a for a in pending.args if isinstance(a, ReplicaRequest)), None)


class CacheAwareRouter(RegisteredRouter, RequestRouter):
    """Longest cached prefix (the replicas' own block hashes), balanced against load; see the module docstring."""

    def initialize_state(self, block_size: int = 16, max_age_s: float = 2.0, recent_ttl_s: float = 3.0,
                         balance_abs: float = 4.0, balance_rel: float = 0.25, min_match_blocks: int = 1,
                         seed: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self._block_size = block_size
        self._max_age_s = max_age_s
        self._policy = CacheAwarePolicy(balance_abs, balance_rel, min_match_blocks)
        self._recent = RecentRoutes(recent_ttl_s)
        self._rng = random.Random(seed)
        self._in_flight: dict[str, int] = defaultdict(int)  # requests this router sent, not yet completed
        self._routed_to: dict[str, str] = {}  # internal request id -> replica id
        # Requests chosen and not routed yet, per internal request id: the replicas preferred for a cache hit, and
        # the one it ranked first; those first choices counted per replica, part of its load ("Bursts" above).
        self._pending: dict[str, tuple[frozenset[str], str]] = {}
        self._choosing: dict[str, int] = defaultdict(int)
        # The newest summary of each replica, parsed once (the stats dict is replaced when a new one arrives).
        self._parsed: dict[str, tuple[dict, CacheSummary | None]] = {}
        self.decisions: Counter = Counter()  # reason -> requests routed (router_registry.decisions)
        super().initialize_state()

    def _view(self, replica: RunningReplica, now: float) -> ReplicaView:
        rid = replica.replica_id.to_full_id_str()
        stats = replica.routing_stats
        cached = self._parsed.get(rid)
        if cached is None or cached[0] is not stats:
            cached = (stats, CacheSummary.from_stats(stats))
            self._parsed[rid] = cached
        summary = cached[1]
        keys = frozenset()
        published_load = 0
        num_cached = 0
        if summary is not None and summary.age(now) <= self._max_age_s:
            keys = summary.usable_keys(now, self._max_age_s)
            published_load = summary.load
            num_cached = len(summary.keys)
        recent = self._recent.live(rid)
        return ReplicaView(rid, Either(keys, recent) if recent else keys,
                           max(self._in_flight[rid] + self._choosing[rid], published_load), num_cached)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _request_of(pending_request)
        if request is None:  # not a generation (stats, info): any replica, uniformly at random
            order = list(candidate_replicas)
            self._rng.shuffle(order)
            return [[r] for r in order]
        keys = prompt_keys(request.prompt_token_ids, self._block_size, cache_salt=request.params.cache_salt)
        now = time.time()
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        ranking = self._policy.choose(keys, [self._view(r, now) for r in candidate_replicas], self._rng)
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            self._forget_choice(request_id)  # chosen again (its first choice was full): the new choice counts
            first = ranking.order[0].replica_id
            self._pending[request_id] = (ranking.hits, first)
            self._choosing[first] += 1
            if len(self._pending) > _MAX_PENDING:  # requests cancelled before they were routed never pop theirs
                self._forget_choice(next(iter(self._pending)))
        return [[by_id[v.replica_id]] for v in ranking.order]

    def _forget_choice(self, request_id: str) -> frozenset[str] | None:
        """Drop ``request_id``'s pending choice (its replica's count with it); returns its cache-hit replicas, or
        None if it had no pending choice."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return None
        hits, first = entry
        self._choosing[first] = max(0, self._choosing[first] - 1)
        return hits

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = replica_id.to_full_id_str()
        hits = self._forget_choice(pending_request.metadata.internal_request_id)
        self._in_flight[rid] += 1
        self._routed_to[pending_request.metadata.internal_request_id] = rid
        request = _request_of(pending_request)
        if request is not None:  # where the prefix really went (the first choice may have been full)
            self.decisions[CACHE_HIT if hits and rid in hits else LOAD] += 1
            self._recent.add(rid, prompt_keys(request.prompt_token_ids, self._block_size,
                                              cache_salt=request.params.cache_salt))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed_to.pop(internal_request_id, None) or replica_id.to_full_id_str()
        self._in_flight[rid] = max(0, self._in_flight[rid] - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._recent.forget(replica_id.to_full_id_str())
        self._choosing.pop(replica_id.to_full_id_str(), None)
