"""Errors as the OpenAI API returns them: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Status by cause: 400 for malformed JSON, values out of range and bodies the
schema refuses (unknown fields, wrong types, missing fields: vLLM and OpenAI
answer these 400 too, not FastAPI's 422, so clients get the ``BadRequestError``
they catch); missing or bad API key 401; unknown model or route 404; body over
the size limit 413; queue full 503 with ``Retry-After``; an engine that failed
503; anything else 500. A refused request never reaches the engine, so every
other request keeps running.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from asyncbatch.errors import EngineDeadError
from asyncbatch.serve.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("asyncbatch.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable_error"}


class OpenAIError(Exception):
    """A refusal with its HTTP status; ``param`` names the offending field where there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    """The error object as a JSON body, for the raw ASGI guard (which runs before FastAPI)."""
    return json.dumps(error_body(status, message, None, code)).encode()


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "the request body is not valid JSON: " + "; ".join(str(e.get("msg")) for e in errors), None
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        name = ".".join(loc) or "body"
        param = param or name
        if e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {name!r}")
        elif e.get("type") == "missing":
            parts.append(f"missing field {name!r}")
        else:
            parts.append(f"{name}: {e.get('msg')} (got {e.get('input')!r})"[:300])
    return 400, "; ".join(parts), param


def install_error_handlers(app: FastAPI, on_reject: Callable[[int], None] = lambda status: None) -> None:
    """Answer every refusal with the OpenAI error object; ``on_reject(status)`` counts each one answered here
    (a 4xx, or a 503: the request never reached the engine), not the 500s of internal errors."""

    def refuse(status: int, message: str, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
        if status < 500 or status == 503:
            on_reject(status)
        return error_response(status, message, param, code, headers)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return refuse(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _schema(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refuse(*_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return refuse(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONResponse:
        return refuse(400, str(exc), _param_of(str(exc)))

    @app.exception_handler(TypeError)
    async def _type(request: Request, exc: TypeError) -> JSONResponse:
        return refuse(400, str(exc), _param_of(str(exc)))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return refuse(503, f"the engine is not running: {exc}", code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


_FIELDS = frozenset(ChatCompletionRequest.model_fields) | frozenset(CompletionRequest.model_fields)


def _param_of(message: str) -> str | None:
    """The field our ValueErrors name first: ``SamplingParams.top_p must be ...`` -> ``top_p``, and a request
    field at the head (``continue_final_message and add_generation_prompt cannot ...``, ``messages must ...``)."""
    head = message.split(" ", 1)[0]
    if head.startswith("SamplingParams."):
        return head.removeprefix("SamplingParams.")
    return head if head in _FIELDS else None
