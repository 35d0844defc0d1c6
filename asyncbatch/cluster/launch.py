"""Build the cluster application (ingress + N engine replicas + a router) and run it on Ray Serve.

    local:       asyncbatch serve --replicas 4 --router cache-aware          (starts Ray on this machine)
    multi-node:  ray start --head                        # on the head node
                 ray start --address=HEAD_IP:6379        # on every other node
                 asyncbatch serve --replicas 8 --address auto                # on the head node

The same application runs on both: Ray places the replicas wherever resources allow (one GPU each with
``--device cuda``), and nothing here assumes one node. Only the keys' hash scheme must match on every node
(the same CPython build, see ``cache_summary``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from asyncbatch.cluster.deployment import EngineReplica
from asyncbatch.cluster.ingress import Ingress
from asyncbatch.cluster.router import CacheAwareRouter
from asyncbatch.serve.settings import ServeSettings

ROUTERS = ("cache-aware", "pow2", "ray-prefix")
APP_NAME = "asyncbatch"
REPLICA_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
# How often a stopping replica checks that its requests are done (Ray Serve's default: 2 s). The server's
# drain (lifecycle) has already ended every stream when Serve stops the replicas, so a short poll only saves
# the wait; requests still running are still waited for (up to Serve's graceful_shutdown_timeout_s).
SHUTDOWN_POLL_S = 0.2


@dataclass(slots=True)
class ClusterSpec:
    """How many replicas, routed how. ``stats_period_s``: how often each replica publishes its summary;
    ``max_age_s``: older summaries are ignored by the cache-aware router (>= 2 periods, so one late
    collection does not blank a replica). ``router_kwargs`` override ``CacheAwareRouter.initialize_state``'s
    (or Ray's prefix router's) keywords."""

    num_replicas: int = 2
    router: str = "cache-aware"
    stats_period_s: float = 0.5
    max_age_s: float = 2.0
    max_ongoing_requests: int = 256  # per replica; beyond it the router queues (the engine has its own queue)
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0
    router_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.num_replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if not 0 < self.stats_period_s <= 60:
            raise ValueError(f"stats_period_s must be in (0, 60], got {self.stats_period_s}")
        if self.max_age_s < self.stats_period_s:
            raise ValueError(f"max_age_s must be >= stats_period_s ({self.stats_period_s}), got {self.max_age_s}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")


def router_config(spec: ClusterSpec, block_size: int) -> RequestRouterConfig:
    period = {"request_routing_stats_period_s": spec.stats_period_s,
              "request_routing_stats_timeout_s": max(5.0, 4 * spec.stats_period_s)}
    if spec.router == "cache-aware":
        kwargs = {"block_size": block_size, "max_age_s": spec.max_age_s, **spec.router_kwargs}
        return RequestRouterConfig(request_router_class=CacheAwareRouter, request_router_kwargs=kwargs, **period)
    from asyncbatch.cluster.observed_routers import ObservedPow2Router, ObservedPrefixRouter

    if spec.router == "ray-prefix":
        # Ray's own (ray.serve.llm.request_router.PrefixCacheAffinityRouter; imported from its defining
        # module because ray.serve.llm's package import needs pyarrow). It matches the text of the argument's
        # ``prompt`` attribute against a tree of what it routed before, not the replicas' caches.
        kwargs = {"imbalanced_threshold": 8, **spec.router_kwargs}
        return RequestRouterConfig(request_router_class=ObservedPrefixRouter, request_router_kwargs=kwargs,
                                   **period)
    # Ray Serve's default: power of two choices
    return RequestRouterConfig(request_router_class=ObservedPow2Router, **period)


def replica_deployment(spec: ClusterSpec, model: str | None, engine_kwargs: dict, name: str = REPLICA_DEPLOYMENT):
    block_size = int(engine_kwargs.get("block_size", 16))
    return serve.deployment(EngineReplica, name=name, num_replicas=spec.num_replicas,
                            max_ongoing_requests=spec.max_ongoing_requests,
                            ray_actor_options={"num_cpus": spec.replica_num_cpus, "num_gpus": spec.replica_num_gpus},
                            request_router_config=router_config(spec, block_size),
                            health_check_period_s=2.0, health_check_timeout_s=10.0,
                            graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
                            ).bind(model, engine_kwargs)


def build_app(spec: ClusterSpec, model: str | None, engine_kwargs: dict, settings: ServeSettings):
    """The application: ``Ingress`` (HTTP, OpenAI API) bound to ``num_replicas`` ``EngineReplica``s."""
    replicas = replica_deployment(spec, model, engine_kwargs)
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=4096,
                               ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
    return ingress.bind(replicas, model, engine_kwargs, settings)


def start_ray(address: str | None, num_replicas: int, replica_num_cpus: float) -> bool:
    """Connect to ``address`` ("auto": the cluster ``ray start`` made), or start a local one sized so that
    every replica is placed (Ray's CPU count is a scheduling budget, not a thread limit). True if this call
    started a local Ray (so its caller owns it and shuts it down: ``ray_processes.shutdown_owned_ray``)."""
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address)
        return False
    cpus = max(os.cpu_count() or 1, int(num_replicas * replica_num_cpus + 1))
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return True


def run(spec: ClusterSpec, model: str | None, engine_kwargs: dict, settings: ServeSettings, host: str, port: int,
        address: str | None = None, blocking: bool = True):
    """Start (or join) Ray, deploy the application behind Serve's HTTP proxy on ``host:port``."""
    start_ray(address, spec.num_replicas, spec.replica_num_cpus)
    return deploy(spec, model, engine_kwargs, settings, host, port, blocking)


def deploy(spec: ClusterSpec, model: str | None, engine_kwargs: dict, settings: ServeSettings, host: str,
           port: int, blocking: bool = False):
    """Deploy the application on the Ray this process is connected to; returns once it runs."""
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_app(spec, model, engine_kwargs, settings), name=APP_NAME, route_prefix="/",
                     blocking=blocking)


def shutdown() -> None:
    serve.shutdown()
    ray.shutdown()
