"""Ray's own routers (``--router pow2`` and ``ray-prefix``), registered so the ingress's ``/metrics`` reads
the replicas' stats through them (``router_registry``), as it does through ``CacheAwareRouter``.

They route exactly as Ray's classes do; they make no cache-or-load decision of asyncbatch's, so
``asyncbatch:router_decisions_total`` is reported for the cache-aware router only.
"""

from __future__ import annotations

# Ray Serve's default router is not exported under a public name (ray.serve.request_router exports the base
# classes only); pinned Ray (the cluster extra).
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (  # private-name: Ray's prefix router (ray.serve.llm needs pyarrow)
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router.pow_2_router import (  # private-name: Ray's default router, not exported
    PowerOfTwoChoicesRequestRouter,
)

from asyncbatch.cluster.router_registry import RegisteredRouter


class ObservedPow2Router(RegisteredRouter, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default (power of two choices), registered."""


class ObservedPrefixRouter(RegisteredRouter, PrefixCacheAffinityRouter):
    """Ray's ``PrefixCacheAffinityRouter`` (``--router ray-prefix``), registered."""
