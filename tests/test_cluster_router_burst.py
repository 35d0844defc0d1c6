"""The cache-aware router under a burst, without a Ray cluster: Ray Serve chooses replicas for several pending
requests before the first is routed, so a choice must count on the replica it ranked first at once. Otherwise
every request of the burst sees the same loads and ranking, and the whole burst lands on one replica (the
Ray kill test once found all eight of its streams on one replica)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="the cluster extra is not installed (pip install -e '.[cluster]')")

from asyncbatch.cluster.cache_summary import CacheSummary
from asyncbatch.cluster.request import ReplicaRequest
from asyncbatch.cluster.router import CacheAwareRouter
from asyncbatch.sampling_params import SamplingParams


def _replica(name: str, cached_keys: int) -> SimpleNamespace:
    summary = CacheSummary(16, frozenset(range(1, cached_keys + 1)), 0, 0, 1.0, time.time())
    return SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: name), routing_stats=summary.to_stats())


def _pending(k: int) -> SimpleNamespace:
    request = ReplicaRequest([7, k, 9] * 10, SamplingParams(max_tokens=4), f"r{k}")
    return SimpleNamespace(args=[request], metadata=SimpleNamespace(internal_request_id=f"internal-{k}"))


def _router() -> CacheAwareRouter:
    router = CacheAwareRouter.__new__(CacheAwareRouter)  # Ray builds it with a deployment; only its state is tested
    router.initialize_state(block_size=16, seed=0)
    return router


def test_a_burst_chosen_before_any_is_routed_is_spread_over_the_replicas():
    router = _router()
    # Equal (zero) load; "a" caches more blocks, so every tie-break before the fix preferred "b".
    replicas = [_replica("a", 40), _replica("b", 0)]
    pending = [_pending(k) for k in range(8)]
    firsts = [asyncio.run(router.choose_replicas(replicas, p))[0][0].replica_id.to_full_id_str() for p in pending]
    assert sorted(firsts) == ["a"] * 4 + ["b"] * 4, firsts
    # Routing moves each choice into the in-flight count where the request went (here: all to "a", the first
    # choices of "b" being full): the choosing counts are gone, the loads are the real ones.
    for p in pending:
        router.on_request_routed(p, replicas[0].replica_id, None)
    assert dict(router._choosing) == {"a": 0, "b": 0}
    assert router._in_flight["a"] == 8
    nxt = asyncio.run(router.choose_replicas(replicas, _pending(99)))
    assert nxt[0][0].replica_id.to_full_id_str() == "b"


def test_choosing_again_counts_the_new_choice_only():
    router = _router()
    replicas = [_replica("a", 0), _replica("b", 0)]
    p = _pending(1)
    asyncio.run(router.choose_replicas(replicas, p))
    asyncio.run(router.choose_replicas(replicas, p))  # its first choice was full: Ray asks again
    assert sum(router._choosing.values()) == 1
