"""A tiny OpenAI-compatible server that streams deterministic tokens, for the serving benchmark's tests.

Output token i of every request is the text ``"t<i> "``, one token per SSE chunk, ``token_delay_s``
apart; the last chunk carries ``finish_reason: "length"``, then a usage chunk (when asked for with
``stream_options.include_usage``), then ``data: [DONE]``. Prompt tokens are the length of a token-id
prompt, or the number of whitespace-separated words of a text prompt.

Misbehaviour on demand, chosen by the prompt text:

- ``"disconnect"``: two tokens, then the connection is dropped mid-stream;
- ``"error-event"``: one token, then ``data: {"error": {...}}``;
- ``"no-finish"``: two tokens, then the stream ends cleanly with neither finish_reason nor [DONE];
- ``"no-done"``: a normal stream without the final ``[DONE]`` (as transformers serve ends its streams);
- ``"multi"``: two tokens per chunk;
- ``"blank"``: every token's text is empty (as special tokens or partial characters stream).

``max_tokens`` above 1000 answers HTTP 400, an unknown model 404. ``GET /metrics`` exports asyncbatch's
device counters, advancing busy by 0.8 s per 1 s of span at every scrape, and one running request per
request in flight.

Run in a thread (``FakeServer``) or as a process: ``python tests/fake_openai_server.py --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from serve_harness import UvicornThread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

MODEL = "fake-model"
MAX_TOKENS_LIMIT = 1000


class _State:
    def __init__(self, token_delay_s: float) -> None:
        self.token_delay_s = token_delay_s
        self.in_flight = 0
        self.scrapes = 0
        self.generated = 0
        self.bodies: list[dict] = []


class Disconnect(Exception):
    """Raised inside a streaming body: uvicorn then closes the connection without ending the body."""


def build_app(token_delay_s: float = 0.002) -> Starlette:
    state = _State(token_delay_s)

    async def health(_request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def models(_request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(_request: Request) -> PlainTextResponse:
        state.scrapes += 1
        n = state.scrapes
        text = ("# TYPE asyncbatch:device_busy_seconds_total counter\n"
                f'asyncbatch:device_busy_seconds_total{{model_name="{MODEL}"}} {0.8 * n}\n'
                f'asyncbatch:device_span_seconds_total{{model_name="{MODEL}"}} {1.0 * n}\n'
                f'asyncbatch:num_requests_running{{model_name="{MODEL}"}} {state.in_flight}\n'
                f'asyncbatch:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
                f'asyncbatch:generation_tokens_total{{model_name="{MODEL}"}} {state.generated}\n')
        return PlainTextResponse(text)

    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        return await _generate(request, chat=False)

    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> JSONResponse | StreamingResponse:
        body = await request.json()
        state.bodies.append(body)
        if body.get("model") != MODEL:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}}, status_code=404)
        max_tokens = int(body.get("max_tokens") or 16)
        if max_tokens > MAX_TOKENS_LIMIT:
            return JSONResponse({"error": {"message": "max_tokens too large"}}, status_code=400)
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        mode = prompt if isinstance(prompt, str) else ""
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and mode != "no-usage"

        def chunk(text: str, finish: str | None = None) -> str:
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"

        async def stream():
            state.in_flight += 1
            try:
                if chat:
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
                per_chunk = 2 if mode == "multi" else 1
                sent = 0
                while sent < max_tokens:
                    await asyncio.sleep(state.token_delay_s)
                    k = min(per_chunk, max_tokens - sent)
                    text = "".join(f"t{sent + j} " for j in range(k))
                    sent += k
                    state.generated += k
                    if mode == "disconnect" and sent > 2:
                        raise Disconnect("dropped on purpose")
                    if mode == "error-event" and sent > 1:
                        yield f"data: {json.dumps({'error': {'message': 'boom'}})}\n\n"
                        return
                    if mode == "no-finish" and sent > 2:
                        return
                    yield chunk("" if mode == "blank" else text, "length" if sent == max_tokens else None)
                if usage:
                    u = {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                         "total_tokens": prompt_tokens + sent}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': u})}\n\n"
                if mode != "no-done":
                    yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat, methods=["POST"])])
    app.state.fake = state
    return app


class FakeServer(UvicornThread):
    """The app under uvicorn on a free loopback port, in a daemon thread; a context manager."""

    def __init__(self, token_delay_s: float = 0.002) -> None:
        self.app = build_app(token_delay_s)
        config = uvicorn.Config(self.app, log_level="critical", lifespan="off")
        super().__init__(uvicorn.Server(config), name="fake-openai-server")

    @property
    def base_url(self) -> str:
        return self.url

    @property
    def state(self) -> _State:
        return self.app.state.fake


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.002)
    args = parser.parse_args()
    uvicorn.run(build_app(args.token_delay), host="127.0.0.1", port=args.port, log_level="warning")
