"""The cache-aware routing decision, free of Ray: longest cached prefix, balanced against load.

Inputs are plain data: the prompt's chain keys (``cache_summary.prompt_keys``) and one ``ReplicaView`` per
candidate (the keys it may be trusted to hold, and its load). The rule, after SGLang's cache-aware router:

1. ``floor`` = the lowest load. Replicas within ``slack = max(balance_abs, balance_rel * floor)`` of it are
   *eligible*; the others are busy enough that a cache hit there would be paid for in queueing.
2. Among eligible replicas, the one holding the longest run of the prompt's leading blocks wins (if that run
   is at least ``min_match_blocks``); ties go to the lower load, then to the tie-break order.
3. Otherwise (nothing cached anywhere eligible), the least loaded replica wins; ties go to the one caching
   fewest blocks, which spreads new prefixes over the emptiest caches.

Invariants: the result is a permutation of the candidates (every replica stays reachable, in preference
order, so a caller can fall back when its first choice is full); a replica more than ``slack`` above the
floor is never ranked first; with no keys anywhere the policy is least-loaded (join-shortest-queue).

``RecentRoutes`` covers the gap between two summaries: a router remembers the keys it just sent to a replica
(that replica will cache them within a step or two) for ``ttl_s``; after that only the replica's own summary
counts. Without it, a burst of one tenant's requests arriving inside one summary period would be spread by
load alone before any summary shows its prefix.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the policy knows of one replica now."""

    replica_id: str
    keys: Container[int]  # chain keys it is trusted to hold (empty if its summary is stale)
    load: float  # requests running + waiting, including those routed to it since its summary
    num_cached: int = 0  # blocks it caches (tie-break for new prefixes)


class Ranking(NamedTuple):
    order: list[ReplicaView]  # every candidate, most preferred first
    hits: frozenset[str]  # ids of the eligible replicas holding >= min_match_blocks of the prompt


@dataclass(frozen=True, slots=True)
class CacheAwarePolicy:
    balance_abs: float = 4.0  # requests of load difference always tolerated for a cache hit
    balance_rel: float = 0.25  # ... or this fraction of the lowest load, whichever is larger
    min_match_blocks: int = 1  # a shorter cached run does not count as a hit

    def __post_init__(self) -> None:
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {self.balance_abs}")
        if self.balance_rel < 0:
            raise ValueError(f"balance_rel must be >= 0, got {self.balance_rel}")
        if self.min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be >= 1, got {self.min_match_blocks}")

    def rank(self, prompt_keys: Sequence[int], replicas: Sequence[ReplicaView],
             rng: random.Random | None = None) -> list[ReplicaView]:
        """``replicas`` in preference order for a prompt with these chain keys (see the module docstring)."""
        return self.choose(prompt_keys, replicas, rng).order

    def choose(self, prompt_keys: Sequence[int], replicas: Sequence[ReplicaView],
               rng: random.Random | None = None) -> Ranking:
        """``rank``, plus which replicas were preferred for a cache hit (to tell routing by cache from
        routing by load)."""
        if not replicas:
            return Ranking([], frozenset())
        order = list(replicas)
        (rng or random).shuffle(order)  # the last tie-break: random, so equal replicas share the work
        floor = min(r.load for r in order)
        slack = max(self.balance_abs, self.balance_rel * floor)
        hits: dict[str, int] = {}
        for r in order:
            matched = matched_blocks(prompt_keys, r.keys)
            if r.load <= floor + slack and matched >= self.min_match_blocks:
                hits[r.replica_id] = matched

        def preference(r: ReplicaView) -> tuple:
            return (r.load > floor + slack, -hits.get(r.replica_id, 0), r.load, r.num_cached)

        # stable: the shuffle breaks the remaining ties
        return Ranking(sorted(order, key=preference), frozenset(hits))


def matched_blocks(prompt_keys: Sequence[int], cached: Container[int]) -> int:
    """How many of the prompt's leading blocks are cached: keys chain, so the run stops at the first miss."""
    n = 0
    for key in prompt_keys:
        if key not in cached:
            break
        n += 1
    return n


class Either:
    """Membership in either of two containers, without building their union (a routing decision per request
    would otherwise copy thousands of keys per replica)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[int], b: Container[int]) -> None:
        self.a = a
        self.b = b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


class RecentRoutes:
    """Keys this router sent to each replica in the last ``ttl_s`` seconds (bounded: ``max_keys`` per replica,
    oldest dropped first). Routing is single-threaded in the router's event loop, so no lock."""

    def __init__(self, ttl_s: float = 5.0, max_keys: int = 65536) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._by_replica: dict[str, OrderedDict[int, float]] = {}

    def add(self, replica_id: str, keys: Iterable[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        table = self._by_replica.setdefault(replica_id, OrderedDict())
        for key in keys:
            table[key] = now
            table.move_to_end(key)
        while len(table) > self.max_keys:
            table.popitem(last=False)

    def keys(self, replica_id: str, now: float | None = None) -> frozenset[int]:
        """The keys sent to ``replica_id`` within ``ttl_s`` (older ones are dropped now)."""
        return frozenset(self.live(replica_id, now))

    def live(self, replica_id: str, now: float | None = None) -> Container[int]:
        """``keys`` without the copy: a live view for membership tests, valid until the next ``add``."""
        table = self._by_replica.get(replica_id)
        if not table:
            return frozenset()
        now = time.monotonic() if now is None else now
        while table and next(iter(table.values())) < now - self.ttl_s:
            table.popitem(last=False)
        return table

    def forget(self, replica_id: str) -> None:
        """A replica died or restarted: what was sent to it is gone with its cache."""
        self._by_replica.pop(replica_id, None)
