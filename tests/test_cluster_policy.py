"""The cache-aware routing policy and replica summaries on synthetic cache states (no Ray needed)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from asyncbatch.cluster.cache_summary import CacheSummary, hash_scheme, prompt_keys
from asyncbatch.cluster.routing_policy import CacheAwarePolicy, RecentRoutes, ReplicaView, matched_blocks
from asyncbatch.engine.prefix_cache import chain_keys, salted_root

BS = 16
TENANT_A = list(range(1000, 1000 + 8 * BS))
TENANT_B = list(range(5000, 5000 + 8 * BS))


def view(name: str, tokens: list[int] = (), load: float = 0, blocks: int | None = None) -> ReplicaView:
    keys = prompt_keys(list(tokens), BS)[:blocks]
    return ReplicaView(name, frozenset(keys), load, len(keys))


def test_prompt_keys_are_the_engines_chain_keys():
    keys: list[int] = []
    chain_keys(TENANT_A + [1, 2, 3], BS, keys, [])
    assert prompt_keys(TENANT_A + [1, 2, 3], BS) == keys and len(keys) == 8
    assert prompt_keys(TENANT_A, BS, max_blocks=3) == keys[:3]
    salted: list[int] = []  # a cache salt's keys: the engine's for that salt, none of the unsalted ones
    chain_keys(TENANT_A + [1, 2, 3], BS, salted, [], salted_root("s")[0])
    assert prompt_keys(TENANT_A + [1, 2, 3], BS, cache_salt="s") == salted and not set(salted) & set(keys)


def test_keys_are_the_same_in_another_process_whatever_the_hash_seed_and_need_no_ray():
    # ... and the CLI, the policy and the summaries import no Ray (only the cluster's Ray side does).
    code = ("import sys; import asyncbatch.cli.main, asyncbatch.cluster.routing_policy; "
            "from asyncbatch.cluster.cache_summary import prompt_keys; assert 'ray' not in sys.modules; "
            f"print(prompt_keys(list(range(1000, {1000 + 8 * BS})), {BS}))")
    # This process runs with some random str hash seed; the child with another fixed one.
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": "12345"}, capture_output=True,
                         text=True, check=True).stdout
    assert out == f"{prompt_keys(TENANT_A, BS)}\n"


def test_matched_blocks_stops_at_the_first_miss():
    keys = prompt_keys(TENANT_A, BS)
    assert matched_blocks(keys, frozenset(keys[:5])) == 5
    assert matched_blocks(keys, frozenset(keys[1:])) == 0  # the chain is broken at block 0
    assert matched_blocks(keys, frozenset()) == 0


def test_the_longest_cached_prefix_wins_at_equal_load():
    keys = prompt_keys(TENANT_A + [7] * 20, BS)
    replicas = [view("r0", TENANT_B, 2), view("r1", TENANT_A, 2, blocks=3), view("r2", TENANT_A, 2),
                view("r3", [], 2)]
    ranked = CacheAwarePolicy().rank(keys, replicas, random.Random(0))
    assert [r.replica_id for r in ranked[:2]] == ["r2", "r1"]
    assert sorted(r.replica_id for r in ranked) == ["r0", "r1", "r2", "r3"]  # everyone stays reachable


def test_a_cache_hit_yields_to_load_beyond_the_slack():
    keys = prompt_keys(TENANT_A, BS)
    policy = CacheAwarePolicy(balance_abs=4, balance_rel=0.25)
    within = [view("hot", TENANT_A, 14), view("idle", [], 10)]  # slack max(4, 2.5) = 4
    assert policy.rank(keys, within)[0].replica_id == "hot"
    beyond = [view("hot", TENANT_A, 15), view("idle", [], 10)]
    assert policy.rank(keys, beyond)[0].replica_id == "idle"
    relative = [view("hot", TENANT_A, 120), view("idle", [], 100)]  # slack 25
    assert policy.rank(keys, relative)[0].replica_id == "hot"


def test_without_any_hit_it_is_least_loaded_then_emptiest_cache():
    keys = prompt_keys(TENANT_A, BS)
    assert CacheAwarePolicy().rank(keys, [view("a", TENANT_B, 3), view("b", [], 1)])[0].replica_id == "b"
    assert CacheAwarePolicy().rank(keys, [view("full", TENANT_B, 1), view("empty", [], 1)])[0].replica_id == "empty"


def test_equal_replicas_share_new_prefixes():
    keys = prompt_keys(TENANT_A, BS)
    rng = random.Random(1)
    firsts = {CacheAwarePolicy().rank(keys, [view("a"), view("b"), view("c")], rng)[0].replica_id
              for _ in range(50)}
    assert firsts == {"a", "b", "c"}


def test_min_match_blocks_ignores_short_runs():
    keys = prompt_keys(TENANT_A, BS)
    replicas = [view("short", TENANT_A, 1, blocks=1), view("idle", [], 0)]
    assert CacheAwarePolicy(min_match_blocks=1).rank(keys, replicas)[0].replica_id == "short"
    assert CacheAwarePolicy(min_match_blocks=2).rank(keys, replicas)[0].replica_id == "idle"


def test_policy_fields_are_checked():
    with pytest.raises(ValueError, match="balance_abs"):
        CacheAwarePolicy(balance_abs=-1)
    with pytest.raises(ValueError, match="min_match_blocks"):
        CacheAwarePolicy(min_match_blocks=0)


def test_recent_routes_expire_after_ttl_and_are_bounded():
    recent = RecentRoutes(ttl_s=2.0, max_keys=3)
    recent.add("r0", [1, 2], now=10.0)
    recent.add("r0", [3, 4], now=11.0)
    assert recent.keys("r0", now=11.5) == {2, 3, 4}  # bounded: the oldest key went first
    assert recent.keys("r0", now=12.5) == {3, 4}  # keys 1, 2 were sent at 10.0: older than ttl
    assert recent.keys("r0", now=13.5) == frozenset()
    recent.add("r1", [9], now=0.0)
    recent.forget("r1")
    assert recent.keys("r1", now=0.0) == frozenset()


def test_a_stale_summary_offers_no_keys():
    s = CacheSummary(BS, frozenset({1, 2}), 1, 2, 0.5, timestamp=100.0)
    assert s.usable_keys(now=100.5, max_age_s=1.0) == {1, 2}
    assert s.usable_keys(now=101.5, max_age_s=1.0) == frozenset()
    other = CacheSummary(BS, frozenset({1}), 0, 0, 1.0, timestamp=100.0, hash_scheme="pypy-3.10-x-64")
    assert other.usable_keys(now=100.0, max_age_s=1.0) == frozenset()
    assert s.load == 3 and s.hash_scheme == hash_scheme()


def test_summary_round_trips_through_routing_stats_and_checks_fields():
    s = CacheSummary(BS, frozenset({1, 2}), 1, 2, 0.5, timestamp=100.0)
    assert CacheSummary.from_stats(s.to_stats()) == s
    assert CacheSummary.from_stats({}) is None
    with pytest.raises(ValueError, match="kv_free_frac"):
        CacheSummary(BS, frozenset(), 0, 0, 1.5, timestamp=0.0)
    with pytest.raises(ValueError, match="num_running"):
        CacheSummary(BS, frozenset(), -1, 0, 1.0, timestamp=0.0)


def test_the_engine_publishes_the_keys_a_router_computes():
    from asyncbatch import LLM, SamplingParams
    from asyncbatch.config import SimConfig

    prompt = TENANT_A + [1, 2, 3]
    with LLM(device="sim", sim=SimConfig(step_fixed_ms=0.1), num_kv_blocks=64, engine_process=False) as llm:
        assert llm.prefix_cache_keys() == []
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        published = llm.prefix_cache_keys()
        assert set(prompt_keys(prompt, BS)) <= set(published)
        assert len(llm.prefix_cache_keys(max_blocks=3)) == 3
        assert matched_blocks(prompt_keys(prompt, BS), frozenset(published)) == 8
        with pytest.raises(ValueError, match="max_blocks"):
            llm.prefix_cache_keys(max_blocks=-1)


def test_a_slow_replica_gets_no_more_than_its_share():
    """Two replicas, one serving at a third of the other's speed, 8 tenants: the policy's own load signal (in
    flight) keeps the slow one from taking more than its capacity share, though it caches half the tenants."""
    rng = random.Random(0)
    policy = CacheAwarePolicy()
    speed = {"fast": 3, "slow": 1}  # requests finished per tick
    queue = {"fast": 0, "slow": 0}
    cached: dict[str, set[int]] = {"fast": set(), "slow": set()}
    tenants = [prompt_keys([t * 1000 + i for i in range(4 * BS)], BS) for t in range(8)]
    got = {"fast": 0, "slow": 0}
    for _tick in range(2000):
        for _ in range(3):  # arrivals: 3 per tick, 75 % of the total capacity of 4
            keys = tenants[rng.randrange(8)]
            views = [ReplicaView(r, frozenset(cached[r]), queue[r], len(cached[r])) for r in queue]
            best = policy.rank(keys, views, rng)[0].replica_id
            queue[best] += 1
            cached[best].update(keys)
            got[best] += 1
        for r, n in queue.items():
            queue[r] = max(0, n - speed[r])
    share = got["slow"] / sum(got.values())
    assert share <= 0.25 + 0.05, f"the slow replica took {share:.0%} of the requests (capacity share 25 %)"
    assert queue["slow"] <= 10  # and it is not left with a growing backlog


def test_serve_replicas_must_be_at_least_one(capsys):
    from asyncbatch.cli.main import main

    assert main(["serve", "--device", "sim", "--replicas", "0"]) == 2
    assert "--replicas: replicas must be >= 1, got 0" in capsys.readouterr().err


def test_choose_names_the_replicas_preferred_for_a_cache_hit():
    policy = CacheAwarePolicy(balance_abs=2, balance_rel=0)
    ranking = policy.choose(prompt_keys(TENANT_A, BS), [view("a", TENANT_A, load=1), view("b", TENANT_A, load=9),
                                                        view("c", load=0)], random.Random(0))
    assert [v.replica_id for v in ranking.order] == ["a", "c", "b"]
    assert ranking.hits == {"a"}  # b holds the prefix too, but is beyond the slack: not a cache decision
    assert policy.choose(prompt_keys(TENANT_B, BS), [view("a", TENANT_A)]).hits == frozenset()


def test_the_ingress_reports_each_replicas_metrics_and_the_routers_decisions(monkeypatch):
    pytest.importorskip("prometheus_client", reason="the serve extra is not installed")
    import weakref
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from asyncbatch.cluster import router_registry
    from asyncbatch.cluster.cluster_metrics import ClusterCollector
    from asyncbatch.cluster.replica_metrics import STATS_KEY, ReplicaMetrics

    def replica(uid: str, label: str, hits: int) -> SimpleNamespace:
        m = ReplicaMetrics(label, 2, 1, 0.5, 0.9, 3.0, 4.0, 256, hits, 8, 0.0)
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid),
                               routing_stats={"keys": [], STATS_KEY: m.to_stats()})

    class Router:  # what the collector reads of a Ray router: curr_replicas, and decisions if cache-aware
        def __init__(self) -> None:
            self.curr_replicas = {r.replica_id.unique_id: r for r in (replica("x1", "0", 128), replica("y2", "1", 0))}
            self.decisions = {router_registry.CACHE_HIT: 5, router_registry.LOAD: 2}

    # Only this test's router (a Ray driver in this process, as test_cluster_ray's, registers its own).
    monkeypatch.setattr(router_registry, "_ROUTERS", weakref.WeakSet())
    router = Router()
    router_registry.register(router)
    registry = CollectorRegistry()
    registry.register(ClusterCollector("m", lambda: (3, 1)))
    text = generate_latest(registry).decode()
    assert 'asyncbatch:prefix_cache_hits_total{model_name="m",replica="0"} 128.0' in text
    assert 'asyncbatch:prefix_cache_hit_rate{model_name="m",replica="0"} 0.5' in text
    assert 'asyncbatch:num_requests_running{model_name="m",replica="1"} 2.0' in text
    assert 'asyncbatch:router_decisions_total{model_name="m",reason="cache_hit"} 5.0' in text
    assert 'asyncbatch:ingress_requests_waiting{model_name="m"} 1.0' in text
    assert 'asyncbatch:num_replicas{model_name="m"} 2.0' in text
    assert ReplicaMetrics.from_stats({"keys": []}) is None  # a replica that published no metrics yet
    del router  # registered weakly: a router Ray drops is not kept
    assert not router_registry.routers()
