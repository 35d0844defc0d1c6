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
"""

from __future__ import annotations

import asyncio

from ray import serve

from asyncbatch.cluster.cluster_metrics import ClusterCollector
from asyncbatch.cluster.frontend import ClusterEngine, FrontendModel
from asyncbatch.config import EngineConfig
from asyncbatch.engine.builder import resolve_model
from asyncbatch.serve.app import build_app
from asyncbatch.serve.settings import ServeSettings

HEALTH_TIMEOUT_S = 5.0


@serve.ingress()
class Ingress:
    """``model`` and ``engine_kwargs`` as the replicas got them (the tokenizer and limits are resolved here
    too; no weights are loaded)."""

    def __init__(self, replicas, model: str | None, engine_kwargs: dict, settings: ServeSettings,
                 max_retries: int = 1) -> None:
        self._replicas = replicas
        self._settings = settings
        self._resolved = resolve_model(EngineConfig.from_kwargs(model=model, **engine_kwargs))
        self._max_retries = max_retries

    async def __serve_build_asgi_app__(self):
        info = await self._replicas.info.remote()
        model = FrontendModel(self._resolved.tokenizer, self._resolved.spec, info["usable_tokens"])
        engine = ClusterEngine(self._replicas, model, self._max_retries)
        # The engine series come from the replicas (through the router's view of their stats), not from here.
        guard, _state = build_app(engine, self._settings, unhealthy=self._no_replica_answers,
                                  engine_metrics=ClusterCollector(self._settings.served_model_names[0],
                                                                  engine.num_requests))
        return guard

    async def _no_replica_answers(self) -> str | None:
        try:
            await asyncio.wait_for(self._replicas.info.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means no replica answers
            return f"no replica answers: {type(exc).__name__}"
        return None
