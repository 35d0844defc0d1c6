"""The cluster's OpenAI-compatible ingress: ``asyncbatch serve``'s own application, over the replicas.

    client ──HTTP──► Ray Serve proxy ──► Ingress replica (ASGIGuard → FastAPI: validate, tokenize, template)
                                           └─ handle ──► router (CacheAwareRouter | pow2 | Ray's prefix router)
                                                           └──► EngineReplica k (AsyncLLM; streams deltas back)

The application is ``serve.app.build_app`` with a ``ClusterEngine`` in place of ``AsyncLLM``: the same routes
(completions, chat, models, tokenize, detokenize, version, metrics, health), request models, error objects,
API key (``--api-key``), body limit (``--max-request-bytes``) and admission bound (``--max-waiting``, counted
as the requests this ingress sent that have no token yet), so a client sees the same API as with one engine.
It is built when the replica starts (Ray Serve's ``__serve_build_asgi_app__``), after a replica told it the
engines' usable context; ``/health`` also asks a replica. ``/metrics`` carries one set of engine series per
replica (``cluster_metrics``).

``drain`` is the stop signal's work, called by ``asyncbatch serve``'s process (``lifecycle``), as
``serve.server``'s drain is for one engine:

    drain(timeout) ─► draining: /health 503, new requests 503 (shutting_down)
                      in-flight requests go on ─────────────► all done: returns
                                    └─ timeout passes first: abort them (streams end with
                                       finish_reason "abort" and [DONE]), then returns
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ray import serve

from asyncbatch.cluster.cluster_metrics import ClusterCollector
from asyncbatch.config import EngineConfig
from asyncbatch.serve.app import build_app
from asyncbatch.serve.asgi_guard import ASGIGuard
from asyncbatch.serve.settings import ServeSettings
from asyncbatch.serve.state import ServerState

if TYPE_CHECKING:
    from asyncbatch.cluster.frontend import ClusterEngine

log = logging.getLogger("asyncbatch.cluster")

HEALTH_TIMEOUT_S = 5.0
ABORTED_END_S = 10.0  # how long aborted streams may take to send their last frames


@dataclass(frozen=True, slots=True)
class DrainReport:
    in_flight: int  # requests unfinished when the drain began
    aborted: int  # of those, aborted (the timeout passed, or a second signal came)
    unfinished: int  # still not ended after the abort (0 unless a replica stopped answering)

    def to_dict(self) -> dict:
        return asdict(self)


@serve.ingress()
class Ingress:
    """``model`` and ``engine_kwargs`` as the replicas got them (the tokenizer and limits are resolved here
    too; no weights are loaded)."""

    def __init__(self, replicas, model: str | None, engine_kwargs: dict, settings: ServeSettings,
                 max_retries: int = 1) -> None:
        self._replicas = replicas
        self._settings = settings
        # The tokenizer (transformers, torch) is imported here, in the ingress replica: the process that deploys
        # it (``asyncbatch serve --replicas N``) imports this module for the class only.
        from asyncbatch.engine.builder import resolve_model
        from asyncbatch.frontend.generation_defaults import sampling_defaults

        self._config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        self._resolved = resolve_model(self._config)
        self._sampling_defaults = sampling_defaults(self._resolved.spec.path, self._config.generation_config,
                                                    self._config.override_generation_config)
        self._max_retries = max_retries
        self._engine: ClusterEngine | None = None
        self._state: ServerState | None = None
        self._guard: ASGIGuard | None = None
        self._abort_requested = False

    async def __serve_build_asgi_app__(self):
        from asyncbatch.cluster.frontend import ClusterEngine, FrontendModel  # torch: see __init__

        info = await self._replicas.info.remote()
        model = FrontendModel(self._resolved.tokenizer, self._resolved.spec, info["usable_tokens"],
                              self._config.structured_outputs_backend, self._config.structured_outputs_warmup,
                              self._config.scheduling_policy, self._sampling_defaults)
        engine = ClusterEngine(self._replicas, model, self._max_retries)
        # The engine series come from the replicas (through the router's view of their stats), not from here.
        guard, self._state = build_app(engine, self._settings, unhealthy=self._no_replica_answers,
                                       engine_metrics=ClusterCollector(self._settings.served_model_names[0],
                                                                       engine.num_requests))
        self._engine, self._guard = engine, guard
        return guard

    async def drain(self, timeout_s: float) -> dict:
        """Stop admitting, let in-flight requests finish for up to ``timeout_s`` (or until ``abort_now``),
        then abort the rest; returns a ``DrainReport`` as a dict once every stream has ended."""
        engine, state = self._engine, self._state
        if engine is None or state is None or self._guard is None:  # never served: nothing in flight
            return DrainReport(0, 0, 0).to_dict()
        state.draining = True
        in_flight = engine.num_requests()[0]
        log.info("draining %d in-flight requests (up to %.0f s)", in_flight, timeout_s)
        deadline = time.monotonic() + timeout_s
        while engine.num_requests()[0] and time.monotonic() < deadline and not self._abort_requested:
            await asyncio.sleep(0.05)
        aborted = engine.abort_all() if engine.num_requests()[0] else 0
        if aborted:
            log.warning("shutdown timeout: aborting %d in-flight requests", aborted)
        # A request's end reaches its response a few awaits later: wait for the responses too, or the proxy,
        # stopped next, could cut a stream before its last frames ("abort", [DONE]).
        deadline = time.monotonic() + ABORTED_END_S
        while (engine.num_requests()[0] or self._guard.open_posts) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._guard.open_posts:
            log.warning("%d responses still open at the end of the drain", self._guard.open_posts)
        return DrainReport(in_flight, aborted, engine.num_requests()[0]).to_dict()

    async def abort_now(self) -> None:
        """A second stop signal: end the drain's wait now (its requests are aborted)."""
        self._abort_requested = True

    async def _no_replica_answers(self) -> str | None:
        try:
            await asyncio.wait_for(self._replicas.info.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means no replica answers
            return f"no replica answers: {type(exc).__name__}"
        return None
