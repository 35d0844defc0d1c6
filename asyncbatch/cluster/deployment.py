"""``EngineReplica``: one asyncbatch engine (``AsyncLLM``) as a Ray Serve deployment replica.

Each replica owns one engine (its own engine-core process and device). It streams one request's deltas per
``generate`` call, and publishes its ``CacheSummary`` through Ray Serve's ``record_routing_stats`` hook, which
the controller calls every ``request_routing_stats_period_s`` and forwards to every router of the deployment.
The routing stats also carry the replica's ``ReplicaMetrics`` (``replica_metrics``), which the ingress's
``/metrics`` reports per replica. ``check_health`` fails once the engine died, so Ray replaces the replica (its KV cache, and so its published
keys, start empty).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ray import serve
from ray.serve.exceptions import RayServeException

from asyncbatch.cluster.cache_summary import CacheSummary
from asyncbatch.cluster.replica_metrics import STATS_KEY, ReplicaMetrics
from asyncbatch.cluster.request import ReplicaRequest
from asyncbatch.outputs import StreamDelta
from asyncbatch.profiling.timeline import summarize
from asyncbatch.serve.metrics import RECENT_STEPS

if TYPE_CHECKING:
    from asyncbatch.frontend.engine_client import EngineClient


class EngineReplica:
    """The body of the deployment (``launch.build_replica_deployment`` wraps it in ``serve.deployment``)."""

    def __init__(self, model: str | None, engine_kwargs: dict, summary_max_blocks: int = 8192) -> None:
        if summary_max_blocks < 0:
            raise ValueError(f"summary_max_blocks must be >= 0, got {summary_max_blocks}")
        # The engine (torch, transformers) is imported here, in the replica: the process that deploys the
        # replicas (``asyncbatch serve --replicas N``) imports this module for the class only.
        from asyncbatch.serve.async_llm import AsyncLLM

        self.engine = AsyncLLM(model, **engine_kwargs)
        self.client: EngineClient = self.engine.llm  # stats, health, prefix-cache keys
        self._summary_max_blocks = summary_max_blocks
        self._block_size = self.client.config.block_size
        self._usable_blocks = self.client.num_usable_blocks
        self._served = 0
        self._label = _replica_label()

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[StreamDelta]:
        """Stream one choice's deltas (the last has ``finish_reason`` and ``output``). Cancelling the call
        (the caller went away) closes the iteration, which aborts the request in the engine."""
        from asyncbatch.frontend.input_processor import ProcessedRequest  # imported by __init__'s engine

        # The ingress validated it against this engine's limits (``info``): taken as it is, not checked again.
        processed = ProcessedRequest(None, request.prompt_token_ids, request.params)
        (handle,) = self.engine.submit_processed([processed], [request.request_id])
        self._served += 1
        async for delta in handle:
            yield delta

    async def record_routing_stats(self) -> dict:
        """Ray Serve's hook: this replica's ``CacheSummary`` as a plain dict (``CacheSummary.to_stats``), with
        its ``ReplicaMetrics`` under ``replica_metrics.STATS_KEY``."""
        summary, metrics = await asyncio.to_thread(lambda: (self.summary(), self.metrics()))
        return {**summary.to_stats(), STATS_KEY: metrics.to_stats()}

    def summary(self) -> CacheSummary:
        client = self.client
        keys = client.prefix_cache_keys(self._summary_max_blocks, timeout=5.0)
        free = client.num_free_blocks
        unfinished, waiting = self.engine.num_requests()
        return CacheSummary(self._block_size, frozenset(keys), unfinished - waiting, waiting,
                            min(1.0, free / max(1, self._usable_blocks)), time.time())

    def metrics(self) -> ReplicaMetrics:
        client = self.client
        recent = client.timeline.recent(RECENT_STEPS)
        newest = recent[-1] if recent else None
        unfinished, waiting = self.engine.num_requests()
        usage = newest.kv_blocks_used / newest.kv_blocks_usable if newest and newest.kv_blocks_usable else 0.0
        prefix = client.prefix_cache_stats(timeout=5.0)
        enabled = bool(prefix.get("enabled"))
        return ReplicaMetrics(self._label, unfinished - waiting, waiting, usage if unfinished else 0.0,
                              summarize(recent)["device_busy_fraction"], client.timeline.busy_s_total,
                              client.timeline.span_s_total, int(prefix["prompt_tokens"]) if enabled else 0,
                              int(prefix["cached_tokens"]) if enabled else 0,
                              int(prefix["cached_blocks"]) if enabled else 0, time.time())

    async def stats(self) -> dict:
        """For studies and tests: prefix-cache counters, device busy, requests served, and the process id."""
        client = self.client
        timeline = await asyncio.to_thread(client.stats)
        prefix = await asyncio.to_thread(client.prefix_cache_stats)
        busy = [(s.device_start, s.device_end) for s in client.timeline.window()
                if s.device_end > 0]
        return {"pid": os.getpid(), "served": self._served, "prefix": prefix, "timeline": timeline,
                "busy_intervals": busy, "clock": "perf_counter", "perf_now": time.perf_counter(),
                "wall_now": time.time()}

    async def reset(self) -> bool:
        """Forget the prefix cache and the step timeline (between runs of a study)."""
        self.client.reset_stats()
        self._served = 0
        return await asyncio.to_thread(self.client.reset_prefix_cache)

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        """What the ingress needs to validate requests as this engine would."""
        return {"usable_tokens": self._usable_blocks * self._block_size, "block_size": self._block_size,
                "max_model_len": self.engine.max_model_len}

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the asyncbatch engine of this replica died")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def _replica_label() -> str:
    """The replica's rank in its deployment (stable across restarts, see ``replica_metrics``); its unique id
    where Ray gives no rank; "0" for a replica built outside a Serve deployment (tests, direct use)."""
    try:
        context = serve.get_replica_context()
    except RayServeException:
        return "0"
    rank = getattr(context, "rank", None)
    rank = getattr(rank, "rank", rank)
    return str(rank) if isinstance(rank, int) else context.replica_id.unique_id
