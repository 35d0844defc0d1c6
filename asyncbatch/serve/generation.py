"""One HTTP generation request: its choices (prompts x ``n``) submitted together, answered as JSON or SSE.

Streaming: every choice's deltas become ``data: {chunk}`` events in arrival
order, then an optional usage chunk, then ``data: [DONE]``. A client that goes
away mid-stream ends the response task; the choices' async iterators then close
and abort their requests, so their KV blocks are freed within a step. A choice
that fails (``finish_reason == "error"``) or an engine that dies ends the
stream with an ``{"error": ...}`` event and ``[DONE]``; nothing is cut off
silently. Non-streaming: the response is built once every choice finished;
the request is raced against the client's disconnect so a caller that hangs up
aborts its requests too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import StreamingResponse

from asyncbatch.errors import ConstraintConflictError, EngineDeadError, RequestFailedError
from asyncbatch.outputs import RequestOutput, StreamDelta
from asyncbatch.serve.openai_errors import OpenAIError, error_body
from asyncbatch.serve.request_stream import RequestStream, interleave
from asyncbatch.serve.state import ServerState

ChunkBuilder = Callable[[int, StreamDelta], dict | None]  # None: the delta gives the client nothing to send
_background: set[asyncio.Task] = set()  # tasks nobody awaits must be referenced until they finish
log = logging.getLogger("asyncbatch.serve")
ABORT_CONFIRM_S = 60.0  # how long an abandoned choice's final output is awaited (off the response's path)


@dataclass
class Generation:
    """The submitted choices of one request, in choice-index order."""

    state: ServerState
    response_id: str
    model: str
    requests: list[RequestStream]
    prompt_tokens: int  # every distinct prompt counted once
    include_usage: bool = False
    continuous_usage: bool = False
    choices_per_prompt: int = 1  # ``n``: the choices of one prompt are adjacent in ``requests``

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.outputs: list[RequestOutput | None] = [None] * len(self.requests)
        self.streamed = [0] * len(self.requests)  # tokens each choice's stream has carried so far

    def usage(self, final: bool = False) -> dict:
        """Tokens so far: a finished choice's output, an unfinished one's streamed tokens (``continuous_usage``
        chunks count up as the tokens go out, as vLLM's do). ``final`` (the response's usage, every choice
        finished) adds OpenAI's ``prompt_tokens_details``."""
        completion = sum(len(o.token_ids) if o is not None else n for o, n in zip(self.outputs, self.streamed))
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.prompt_tokens + completion}
        if final and all(o is not None for o in self.outputs):
            # OpenAI's field: prompt tokens served from the prefix cache, each prompt counted once (its first
            # choice's first admission, as ``prompt_tokens`` counts it once).
            cached = sum(o.num_cached_tokens or 0 for o in self.outputs[::self.choices_per_prompt])
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _finished(self, index: int, delta: StreamDelta) -> None:
        if delta.output is not None and self.outputs[index] is None:
            self.outputs[index] = delta.output
            self.state.finished(delta.output)

    def _record_abandoned(self) -> None:
        """Choices the response stopped reading (client gone, error) are aborted; log and count how they
        ended once the engine confirms, off the response's path."""
        for index, request in enumerate(self.requests):
            if self.outputs[index] is None:
                request.abort()
                task = asyncio.ensure_future(self._await_final(index, request))
                _background.add(task)
                task.add_done_callback(_background.discard)

    async def _await_final(self, index: int, request: RequestStream) -> None:
        """Nobody awaits this task: what it cannot wait for is logged here, not left as "Task exception was
        never retrieved" (an engine that stopped, or died: the response has ended either way)."""
        try:
            output = await asyncio.wait_for(request.final_output(), timeout=ABORT_CONFIRM_S)
        except asyncio.TimeoutError:
            log.warning("%s: choice %d was abandoned and its abort not confirmed within %.0f s", self.response_id,
                        index, ABORT_CONFIRM_S)
            return
        except (EngineDeadError, RequestFailedError) as exc:
            log.info("%s: choice %d was abandoned and ended with %r", self.response_id, index, exc)
            return
        if output is not None and self.outputs[index] is None:
            self.outputs[index] = output
            self.state.finished(output)

    # -- streaming -------------------------------------------------------------
    async def events(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(choice index, delta) as deltas arrive, until every choice finished."""
        async with contextlib.aclosing(interleave(self.requests)) as merged:  # closed now: its requests abort now
            async for index, delta in merged:
                yield index, delta

    def chunk_head(self, object_name: str) -> dict:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model}

    async def sse(self, object_name: str, first_chunks: list[dict], chunk: ChunkBuilder) -> AsyncIterator[str]:
        """The ``text/event-stream`` body: ``first_chunks`` (e.g. chat's role), one chunk per delta, usage."""
        usage_field = {"usage": None} if self.include_usage else {}
        itl = self.state.metrics.itl
        last_token_time = [0.0] * len(self.requests)
        try:
            for body in first_chunks:
                yield _event({**body, **({"usage": self.usage()} if self.continuous_usage else usage_field)})
            async for index, delta in self.events():
                if delta.token_ids:
                    self.streamed[index] += len(delta.token_ids)
                    now = time.perf_counter()
                    if last_token_time[index]:
                        itl.observe((now - last_token_time[index]) / len(delta.token_ids))
                    last_token_time[index] = now
                if delta.finish_reason is not None:
                    self._finished(index, delta)
                body = chunk(index, delta)
                if body is None:
                    continue
                if self.continuous_usage:
                    body["usage"] = self.usage()
                elif usage_field:
                    body.update(usage_field)
                yield _event(body)
            if self.include_usage:
                yield _event({**self.chunk_head(object_name), "choices": [], "usage": self.usage(final=True)})
        except (RequestFailedError, EngineDeadError) as exc:
            status, code = _failure_status(exc)
            yield _event(error_body(status, str(exc), code=code))
        finally:
            self._record_abandoned()
        yield "data: [DONE]\n\n"

    # -- whole responses -------------------------------------------------------
    async def collect(self, request: Request) -> list[RequestOutput]:
        """Every choice's final output; aborts them all if the client disconnects first."""
        async def drain(index: int, choice: RequestStream) -> None:
            async for delta in choice:
                if delta.finish_reason is not None:
                    self._finished(index, delta)

        work = asyncio.ensure_future(asyncio.gather(*(drain(i, r) for i, r in enumerate(self.requests))))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
            gone.cancel()
        if not work.done() or work.cancelled():
            self._record_abandoned()
            raise OpenAIError(499, "the client disconnected before the response was ready")
        try:
            work.result()
        except RequestFailedError as exc:
            self._record_abandoned()
            status, code = _failure_status(exc)
            raise OpenAIError(status, str(exc), code=code) from exc
        return [o for o in self.outputs if o is not None]


def _failure_status(exc: Exception) -> tuple[int, str]:
    """The HTTP status and error code of a request that failed after it was accepted: 503 when the engine
    died, 400 when the request's own constraints excluded each other (the caller's doing), else 500."""
    if isinstance(exc, EngineDeadError):
        return 503, "engine_dead"
    if isinstance(exc, ConstraintConflictError):
        return 400, "constraints_conflict"
    return 500, "request_failed"


class SSEResponse(StreamingResponse):
    """``text/event-stream`` whose body iterator is closed as soon as the response ends, however it ends:
    a client gone mid-stream aborts its requests now, not whenever the abandoned generator is collected."""

    def __init__(self, body: AsyncIterator[str]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body was already read, so only a disconnect can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
