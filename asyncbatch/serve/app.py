"""The OpenAI-compatible HTTP application: routes, error handlers, and the guard in front.

FastAPI on Starlette, served by uvicorn (``server.py``). FastAPI because the
request bodies are pydantic models that validate the schema (a 400 naming the
field) and document themselves at ``/docs``, as vLLM's and ``transformers
serve``'s servers do; the per-token path does not go through pydantic (SSE
chunks are plain dicts dumped to JSON), so validation costs once per request.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
/v1/models``, ``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST
/detokenize``, ``GET /version``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from prometheus_client.registry import Collector
from starlette.responses import JSONResponse, Response

import asyncbatch
from asyncbatch.serve.asgi_guard import ASGIGuard
from asyncbatch.serve.chat import chat_prompt_ids, create_chat_completion
from asyncbatch.serve.completions import create_completion
from asyncbatch.serve.engine_protocol import AsyncEngineClient
from asyncbatch.serve.metrics import CONTENT_TYPE, ServeMetrics
from asyncbatch.serve.openai_errors import OpenAIError, install_error_handlers
from asyncbatch.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from asyncbatch.serve.settings import ServeSettings
from asyncbatch.serve.state import ServerState


def _prefix_stats(engine: AsyncEngineClient):
    """The engine's prefix-cache figures for ``/metrics``, if it has a prefix cache."""
    def read() -> dict | None:
        if not engine.alive:
            return None
        try:
            return engine.prefix_cache_stats(timeout=2.0)
        except (KeyError, RuntimeError, TimeoutError):
            return None
    return read


def build_app(engine: AsyncEngineClient, settings: ServeSettings, *,
              unhealthy: Callable[[], Awaitable[str | None]] | None = None,
              prefix_stats: Callable[[], dict | None] | None = None,
              engine_metrics: Collector | None = None) -> tuple[ASGIGuard, ServerState]:
    """The ASGI application serving ``engine`` (the caller owns and closes the engine), and its state.

    ``engine`` is an ``AsyncEngineClient``: an ``AsyncLLM``, or the cluster ingress's ``ClusterEngine``;
    ``unhealthy`` (a coroutine returning why the server cannot serve, or None) adds to
    ``/health``'s own checks, ``prefix_stats`` replaces the engine's prefix-cache figures in ``/metrics``,
    ``engine_metrics`` replaces all of its engine series (``ServeMetrics``).
    """
    metrics = ServeMetrics(settings.served_model_names[0], engine.timeline, engine.num_requests,
                           prefix_stats or _prefix_stats(engine), engine_metrics)
    state = ServerState(engine, settings, metrics)
    app = FastAPI(title="asyncbatch", version=asyncbatch.__version__)
    install_error_handlers(app, metrics.rejected)
    started = int(time.time())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": name, "object": "model", "created": started, "owned_by": "asyncbatch",
                 "root": str(engine.model_path), "max_model_len": engine.max_model_len}
                for name in settings.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        reason = await unhealthy() if unhealthy is not None else None
        if reason is not None:
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": asyncbatch.__version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        # Off the loop: reading the prefix-cache figures waits for the engine core's reply.
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        state.check_model(body.model)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise OpenAIError(400, "the server has no tokenizer (skip_tokenizer_init)")
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            # vLLM's default for messages is the chat route's (no special tokens around the template), for a
            # prompt the completions route's: the field decides only where the request sets it.
            special = body.add_special_tokens if "add_special_tokens" in body.model_fields_set else False
            chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         chat_template_kwargs=body.chat_template_kwargs, add_special_tokens=special,
                                         chat_template=body.chat_template)
            ids = chat_prompt_ids(state, chat)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        state.check_model(body.model)
        if engine.tokenizer is None:
            raise OpenAIError(400, "the server has no tokenizer (skip_tokenizer_init)")
        vocab = engine.processor.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"tokens must be in [0, {vocab - 1}], got {bad[:5]}", param="tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})

    guarded = ASGIGuard(app, settings.api_key, settings.max_body_bytes, metrics.rejected)
    return guarded, state
