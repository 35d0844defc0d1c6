"""The request routers living in this process, so the ingress's ``/metrics`` can read what they see.

Ray Serve builds a deployment handle's router itself (from ``RequestRouterConfig``), so the ingress never
holds it; every router class ``launch`` configures registers here when Ray initializes it. A router holds the
replicas' newest routing stats (``curr_replicas``) and, if it decides by cache, ``decisions``.
Weak references: a router Ray drops is not kept alive by being observed.
"""

from __future__ import annotations

import weakref
from collections import Counter

_ROUTERS: weakref.WeakSet = weakref.WeakSet()

# Why a request went where it went (the ``reason`` label of asyncbatch:router_decisions_total).
CACHE_HIT = "cache_hit"  # a replica holding at least min_match_blocks of its prompt, within the load slack
LOAD = "load"  # no eligible replica held its prefix: the least loaded one


def register(router) -> None:
    _ROUTERS.add(router)


def routers() -> list:
    return list(_ROUTERS)


def replica_stats() -> dict[str, dict]:
    """Each replica's newest routing stats, by Ray's replica id (every registered router of the process
    sees the same replicas; the first one seen wins)."""
    out: dict[str, dict] = {}
    for router in routers():
        # Read from the scrape's thread while the router's loop may update it: copy first, retry on a race.
        for _ in range(3):
            try:
                replicas = list(router.curr_replicas.items())
                break
            except RuntimeError:  # dictionary changed size during iteration
                continue
        else:
            continue
        for _, replica in replicas:
            out.setdefault(replica.replica_id.unique_id, replica.routing_stats or {})
    return out


def decisions() -> Counter:
    """Routing decisions by reason, summed over this process's cache-aware routers."""
    total: Counter = Counter()
    for router in routers():
        total.update(getattr(router, "decisions", {}))
    return total


class RegisteredRouter:
    """Mixin for a ``RequestRouter``: registers the router when Ray initializes it (``initialize_state`` is
    called once, with the ``request_router_kwargs``)."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        register(self)
