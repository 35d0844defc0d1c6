"""The first thing every HTTP request meets: the API key and the body size limit, as raw ASGI.

Raw ASGI rather than Starlette's ``BaseHTTPMiddleware``: that one wraps every
response (a cost per SSE chunk) and breaks client-disconnect detection of
streaming responses. The key is checked like vLLM's ``--api-key``: routes under
``/v1`` need ``Authorization: Bearer <key>``; ``/health``, ``/metrics`` and
``/version`` stay open for probes and scrapers. A body larger than the limit is
refused with 413 from its ``Content-Length`` before it is read, or as soon as
the bytes read pass the limit (chunked uploads).

It is also the last thing a request leaves: an internal error that the app has
already answered with a whole 500 (``openai_errors``, which logs it) is not
raised on to uvicorn. Starlette re-raises it after answering, and uvicorn then
closes the connection, so a keep-alive client's next request met a reset
connection instead of an answer.

It counts the POST requests (generation, tokenization) it is still answering (``open_posts``; probes and
scrapes are GETs): the cluster ingress's drain waits for them, so that a stream aborted at shutdown has
handed its last frames (``finish_reason`` "abort", ``[DONE]``) on before Ray Serve's proxy is stopped.
(uvicorn does this wait itself for the single-engine server.)
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException

from asyncbatch.serve.openai_errors import error_bytes

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(HTTPException):
    """Raised inside ``receive`` once a chunked body passes the limit. An ``HTTPException`` because
    FastAPI re-raises those from body parsing (anything else becomes its generic 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


async def _reply(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = error_bytes(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ASGIGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 on_reject: Callable[[int], None] = lambda status: None) -> None:
        self.app = app
        self._key = f"Bearer {api_key}".encode() if api_key else None
        self._limit = max_body_bytes
        self._on_reject = on_reject
        self.open_posts = 0  # POST requests whose answer has not ended (invariant: >= 0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            await self._answer(scope, receive, send)
            return
        self.open_posts += 1
        try:
            await self._answer(scope, receive, send)
        finally:
            self.open_posts -= 1

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or ())
        if self._key is not None and scope.get("path", "").startswith("/v1"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                self._on_reject(401)
                await _reply(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             [(b"www-authenticate", b"Bearer")])
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._limit:
            self._on_reject(413)
            await _reply(send, 413, f"request body of {int(length)} bytes exceeds the limit of {self._limit} bytes")
            return
        seen = 0
        started = completed = False

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._limit:
                    raise BodyTooLarge(self._limit)
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started, completed
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            self._on_reject(413)
            await _reply(send, 413, str(exc.detail))
        except Exception:
            if not completed:  # a response cut short: uvicorn logs it and closes the connection
                raise
