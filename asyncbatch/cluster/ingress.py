"""The cluster's OpenAI-compatible ingress: ``asyncbatch.serve``'s own routes, over the replicas.

    client ──HTTP──► Ray Serve proxy ──► Ingress replica (FastAPI: validate, tokenize, chat template)
                                           └─ handle ──► router (CacheAwareRouter | pow2 | Ray's prefix router)
                                                           └──► EngineReplica k (AsyncLLM; streams deltas back)

The routes are ``serve.completions.create_completion`` and ``serve.chat.create_chat_completion`` with a
``ClusterEngine`` in place of ``AsyncLLM``; request bodies are ``serve.protocol``'s models and errors are
``serve.openai_errors``', so a client sees the same API as ``asyncbatch serve`` with one engine.
"""


import asyncio
import time

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, Response

import asyncbatch
from asyncbatch.cluster.frontend import ClusterEngine, FrontendModel
from asyncbatch.config import EngineConfig
from asyncbatch.engine.builder import resolve_model
from asyncbatch.serve.chat import create_chat_completion
from asyncbatch.serve.completions import create_completion
from asyncbatch.serve.metrics import ServeMetrics
from asyncbatch.serve.openai_errors import install_error_handlers
from asyncbatch.serve.protocol import ChatCompletionRequest, CompletionRequest
from asyncbatch.serve.settings import ServeSettings
from asyncbatch.serve.state import ServerState

app = FastAPI(title="asyncbatch cluster", version=asyncbatch.__version__)
install_error_handlers(app)


@serve.ingress(app)
class Ingress:
    """``model`` and ``engine_kwargs`` as the replicas got them (the tokenizer and limits are resolved here
    too; no weights are loaded)."""

    def __init__(self, replicas, model: str | None, engine_kwargs: dict, settings: ServeSettings,
                 max_retries: int = 1) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        resolved = resolve_model(config)
        self._replicas = replicas
        self._started = int(time.time())
        self._settings = settings
        self._resolved = resolved
        self._max_retries = max_retries
        self._state: ServerState | None = None

    async def _ready_state(self) -> ServerState:
        """Built on first use: the usable context comes from a replica (its KV cache size)."""
        if self._state is None:
            info = await self._replicas.info.remote()
            model = FrontendModel(self._resolved.tokenizer, self._resolved.spec, info["usable_tokens"])
            engine = ClusterEngine(self._replicas, model, self._max_retries)
            metrics = ServeMetrics(self._settings.served_model_names[0], model.timeline, engine.num_requests,
                                   lambda: None)
            self._state = ServerState(engine, self._settings, metrics)
        return self._state

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, await self._ready_state())

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, await self._ready_state())

    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        spec = self._resolved.spec
        data = [{"id": name, "object": "model", "created": self._started, "owned_by": "asyncbatch",
                 "root": str(spec.path), "max_model_len": spec.max_model_len}
                for name in self._settings.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            await asyncio.wait_for(self._replicas.info.remote(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - any failure means no replica answers
            return JSONResponse({"status": f"no replica answers: {type(exc).__name__}"}, status_code=503)
        return JSONResponse({"status": "ok"})
