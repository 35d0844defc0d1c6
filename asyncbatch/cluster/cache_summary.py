"""What one replica publishes about itself for cache-aware routing, and how old it may be before it is ignored.

A replica's summary is read from its own engine core (``LLM.prefix_cache_keys``: the chain keys of its cached
KV blocks, held ones first, then the most recently released, at most ``max_blocks``) plus its load (requests
running, waiting, KV blocks free). Ray Serve collects it every ``period_s`` through the replica's
``record_routing_stats`` hook and hands it to every router, so a router's view is at most about
``period_s + collection latency`` old. Past ``max_age_s`` a summary is *stale*: the router then ignores its cache
keys (they may have been evicted) and falls back to load alone.

Keys are Python ``hash`` values of tuples of ints (``engine.prefix_cache.chain_keys``). Ints and tuples of ints
are not salted by ``PYTHONHASHSEED`` (only ``str``/``bytes`` are), so a router in another process computes the
same keys for the same tokens, provided it runs the same CPython build (a 64-bit build: ``sys.hash_info``).
``hash_scheme`` names that build; a router refuses the keys of a summary whose scheme differs from its own
rather than matching nothing silently.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncbatch.engine.prefix_cache import chain_keys, salted_root


def hash_scheme() -> str:
    """Names what the keys depend on: the interpreter's hash algorithm and width (equal ones give equal keys)."""
    info = sys.hash_info
    return f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}-{info.algorithm}-{info.width}"


def prompt_keys(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                cache_salt: str | None = None) -> list[int]:
    """The chain keys of the full blocks of ``token_ids`` (under the request's ``cache_salt``), exactly as the
    engine's prefix cache names them."""
    tokens = token_ids if max_blocks is None else token_ids[:max_blocks * block_size]
    keys: list[int] = []
    chain_keys(tokens, block_size, keys, [], salted_root(cache_salt)[0])
    return keys


@dataclass(frozen=True, slots=True)
class CacheSummary:
    """One replica's state at ``timestamp`` (``time.time()`` on the replica; hosts' clocks are assumed in sync
    to well under ``max_age_s``, as NTP gives)."""

    block_size: int
    keys: frozenset[int]  # chain keys of cached blocks (bounded by the replica's max_blocks)
    num_running: int  # unfinished requests that have been scheduled
    num_waiting: int  # submitted, not yet scheduled
    kv_free_frac: float  # free + evictable KV blocks / usable blocks, in [0, 1]
    timestamp: float
    hash_scheme: str = field(default_factory=hash_scheme)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_running < 0 or self.num_waiting < 0:
            raise ValueError(f"num_running and num_waiting must be >= 0, got {self.num_running}, {self.num_waiting}")
        if not 0.0 <= self.kv_free_frac <= 1.0:
            raise ValueError(f"kv_free_frac must be in [0, 1], got {self.kv_free_frac}")

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.timestamp

    def usable_keys(self, now: float, max_age_s: float) -> frozenset[int]:
        """The keys a router may trust now: none if the summary is stale or from another hash scheme."""
        if self.age(now) > max_age_s or self.hash_scheme != hash_scheme():
            return frozenset()
        return self.keys

    # Ray's routing stats are a plain dict (pickled between processes): keep the wire format explicit.
    def to_stats(self) -> dict:
        return {"block_size": self.block_size, "keys": list(self.keys), "num_running": self.num_running,
                "num_waiting": self.num_waiting, "kv_free_frac": self.kv_free_frac, "timestamp": self.timestamp,
                "hash_scheme": self.hash_scheme}

    @classmethod
    def from_stats(cls, stats: dict | None) -> CacheSummary | None:
        """The summary in a replica's routing stats; None if it has published none yet."""
        if not stats or "keys" not in stats:
            return None
        return cls(int(stats["block_size"]), frozenset(stats["keys"]), int(stats["num_running"]),
                   int(stats["num_waiting"]), float(stats["kv_free_frac"]), float(stats["timestamp"]),
                   str(stats["hash_scheme"]))
