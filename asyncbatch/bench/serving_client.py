"""The serving benchmark's HTTP client: replays requests against an OpenAI-compatible server, streaming.

One request, as this client times it (``time.perf_counter()`` in this process)::

    sent ──► HTTP 200 ──► chunk 1 ──► chunk 2 ── ... ──► chunk k ──► finish/usage chunk ──► [DONE], close
    │                     │           │                  │                                        │
    sent                  first_token chunk_times[1]     finish (last token delivered)            end

- TTFT = ``first_token - sent``; E2E = ``finish - sent``; ITL = gaps between consecutive
  deliveries; TPOT = ``(E2E - TTFT) / (output_tokens - 1)`` (``metrics`` has the definitions).
- A *delivery* is a chunk whose choice carries non-empty text (``text`` for completions,
  ``delta.content`` for chat). A chat role-only chunk, the final finish/usage chunk, or a token a
  server holds back until a multi-byte character is complete delivers nothing visible to a user, so it
  starts no clock; a server that puts several tokens in one chunk gives one ITL gap for all of them.
  A successful stream whose tokens all had empty text delivers them with its last chunk that has a
  choice (``text_chars`` stays 0; the summary counts such requests).
- Output tokens come from the ``usage`` the server reports (``stream_options.include_usage``); a
  server that reports none is counted by deliveries, which ``tokens_from_usage`` records.
- A request fails (``success`` False, ``error`` says why) on an HTTP status other than 200, a
  transport error or timeout (a dropped connection mid-stream included), an ``error`` event, a stream
  that ends with neither ``[DONE]`` nor a ``finish_reason``, or a stream without any output token.
  Failures are kept and counted, never dropped.

Requests arrive at the given offsets (``arrivals.arrival_offsets``); with ``max_concurrency`` a request
also waits for one of that many slots, and its clock starts when it is sent, as in vLLM's
``benchmark_serving``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from itertools import pairwise

import httpx

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_CHARS = 300  # of an error body or message kept per failed request


@dataclass(frozen=True, slots=True)
class Dialect:
    """How a family of servers spells what the OpenAI API leaves out.

    ``token_id_prompts``: the ``prompt`` of ``/v1/completions`` may be a list of token ids (the OpenAI
    spec allows it; transformers serve answers 400). ``eos``: how to ask for exactly ``max_tokens``
    tokens: ``"ignore_eos"`` (vLLM's extra field, which asyncbatch serve accepts), ``"generation_config"``
    (transformers serve rejects unknown fields with 422 but takes a JSON ``generation_config``, and its
    continuous batching never matches an ``eos_token_id`` of -1), or ``"none"`` (no way: outputs may end
    early at EOS, which the report counts).
    """

    name: str
    token_id_prompts: bool
    eos: str

    def extra_fields(self, ignore_eos: bool, temperature: float) -> dict:
        if not ignore_eos or self.eos == "none":
            return {}
        if self.eos == "ignore_eos":
            return {"ignore_eos": True}
        if self.eos == "generation_config":
            # Replaces the model's generation config for this request: greedy unless sampling was asked for.
            config = {"eos_token_id": -1, "do_sample": temperature > 0}
            return {"generation_config": json.dumps(config)}
        raise ValueError(f"unknown eos mode {self.eos!r} of dialect {self.name!r}")


VLLM = Dialect("vllm", token_id_prompts=True, eos="ignore_eos")  # asyncbatch serve, vLLM, SGLang
TRANSFORMERS = Dialect("transformers", token_id_prompts=False, eos="generation_config")
OPENAI = Dialect("openai", token_id_prompts=True, eos="none")
DIALECTS = {d.name: d for d in (VLLM, TRANSFORMERS, OPENAI)}


@dataclass(frozen=True, slots=True)
class ServingRequest:
    """One request of a workload: a text or token-id prompt and the output tokens asked for;
    ``prompt_len``: the prompt's tokens as the model's tokenizer counts them here (None: not counted)."""

    prompt: str | list[int]
    max_tokens: int
    prompt_len: int | None = None


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """What every request of a run shares."""

    endpoint: str = "completions"
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0  # per request, and per read of the stream
    api_key: str | None = None


@dataclass(slots=True)
class RequestResult:
    """What one request did. Invariants: ``sent <= first_token <= finish <= end`` where set;
    ``chunk_times`` non-decreasing, its first entry ``first_token`` and its last ``finish``;
    ``success`` implies ``error is None`` and at least one output token."""

    index: int
    max_tokens: int
    sent: float
    prompt_len: int | None = None  # the prompt's tokens as counted here (``ServingRequest.prompt_len``)
    end: float | None = None
    success: bool = False
    error: str | None = None
    first_token: float | None = None
    finish: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    saw_done: bool = False
    last_choice: float | None = None  # the latest chunk with a choice, text or not
    prompt_tokens: int | None = None  # as the server reported them in ``usage``
    completion_tokens: int | None = None  # likewise
    text_chars: int = 0

    @property
    def tokens_from_usage(self) -> bool:
        return self.completion_tokens is not None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.sent

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for one-token outputs, which have no second token."""
        if self.first_token is None or self.finish is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_times)]

    def as_dict(self) -> dict:
        """The per-request row of the report (seconds as ms; no ITL list, which grows with the output)."""
        def ms(value: float | None) -> float | None:
            return None if value is None else 1e3 * value
        return {"index": self.index, "success": self.success, "error": self.error, "max_tokens": self.max_tokens,
                "prompt_len": self.prompt_len, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "tokens_from_usage": self.tokens_from_usage, "chunks": len(self.chunk_times),
                "finish_reason": self.finish_reason, "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot),
                "e2e_ms": ms(self.e2e)}


@dataclass(slots=True)
class LoadRun:
    """Every request of one load point; ``start`` is when the replay began, ``end`` when the last
    request ended (answered, failed or timed out). ``client_cpu_s``: this process's CPU time in between
    (the client shares the machine with the server)."""

    results: list[RequestResult]
    start: float
    end: float
    client_cpu_s: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def request_body(model: str, request: ServingRequest, dialect: Dialect, options: ClientOptions) -> dict:
    """The JSON body of one streaming request."""
    body: dict = {"model": model, "max_tokens": request.max_tokens, "temperature": options.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if options.endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint takes text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    elif options.endpoint == "completions":
        if not isinstance(request.prompt, str) and not dialect.token_id_prompts:
            raise ValueError(f"servers of dialect {dialect.name!r} take text prompts, not token ids")
        body["prompt"] = request.prompt
    else:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {options.endpoint!r}")
    body.update(dialect.extra_fields(options.ignore_eos, options.temperature))
    return body


def _choice_text(choice: dict) -> str:
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or ""


def _apply_event(result: RequestResult, event: object, now: float) -> str | None:
    """Fold one decoded SSE event into ``result``; returns an error message if the event is one."""
    if not isinstance(event, dict):
        return f"SSE data is not a JSON object: {str(event)[:_ERROR_CHARS]}"
    if event.get("error") is not None:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return f"error event: {str(message)[:_ERROR_CHARS]}"
    usage = event.get("usage")
    if isinstance(usage, dict):
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
    choices = event.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return f"malformed choices: {str(choices)[:_ERROR_CHARS]}"
    if choices:
        result.last_choice = now
    for choice in choices:
        text = _choice_text(choice)
        if text:
            if result.first_token is None:
                result.first_token = now
            result.finish = now
            result.chunk_times.append(now)
            result.text_chars += len(text)
        if choice.get("finish_reason") is not None:
            result.finish_reason = choice["finish_reason"]
    return None


async def send_request(client: httpx.AsyncClient, path: str, body: dict, index: int,
                       prompt_len: int | None = None) -> RequestResult:
    """Send one streaming request and time it; never raises for a failure of the request itself."""
    result = RequestResult(index=index, max_tokens=int(body["max_tokens"]), sent=time.perf_counter(),
                           prompt_len=prompt_len)
    error: str | None = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                content = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {content[:_ERROR_CHARS]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, ``event:``/``id:`` fields
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        result.saw_done = True
                        break
                    now = time.perf_counter()
                    try:
                        event = json.loads(payload)
                    except json.JSONDecodeError:
                        error = f"SSE data is not JSON: {payload[:_ERROR_CHARS]}"
                        break
                    error = _apply_event(result, event, now)
                    if error is not None:
                        break
    except httpx.TimeoutException as exc:
        error = f"timeout ({type(exc).__name__}) after {len(result.chunk_times)} chunks"
    except httpx.HTTPError as exc:
        # A server that drops the connection mid-stream lands here (incomplete chunked read).
        error = f"{type(exc).__name__} after {len(result.chunk_times)} chunks: {str(exc)[:_ERROR_CHARS]}"
    result.end = time.perf_counter()
    if error is None and not result.saw_done and result.finish_reason is None:
        error = f"stream ended without [DONE] or finish_reason after {len(result.chunk_times)} chunks"
    if error is None and not result.chunk_times and result.last_choice is not None:
        # Tokens whose text is empty (special or partial characters) reach the user with the finish chunk.
        result.first_token = result.finish = result.last_choice
        result.chunk_times.append(result.last_choice)
    if error is None and result.output_tokens == 0:
        error = "stream ended without any output token"
    result.error, result.success = error, error is None
    return result


def make_client(base_url: str, options: ClientOptions, max_connections: int | None = None) -> httpx.AsyncClient:
    """An HTTP/1.1 client for many concurrent streams (httpx pools 100 connections by default)."""
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else None
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(options.timeout_s),
                             limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=None),
                             trust_env=False)  # a loopback benchmark must not go through a proxy from the env


async def replay(base_url: str, model: str, requests: list[ServingRequest], offsets: list[float],
                 dialect: Dialect, options: ClientOptions, max_concurrency: int | None = None) -> LoadRun:
    """Send ``requests[i]`` at ``start + offsets[i]`` (and, with ``max_concurrency``, once a slot is
    free); return when every request has ended."""
    if len(offsets) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(offsets)} arrival offsets")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    path = ENDPOINTS[options.endpoint]
    bodies = [request_body(model, r, dialect, options) for r in requests]  # bad input fails before any send
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None
    async with make_client(base_url, options, max_concurrency) as client:
        cpu0 = time.process_time()
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is None:
                return await send_request(client, path, bodies[i], i, requests[i].prompt_len)
            async with slots:
                return await send_request(client, path, bodies[i], i, requests[i].prompt_len)

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        end = max([start, *(r.end for r in results if r.end is not None)])
        return LoadRun(list(results), start, end, time.process_time() - cpu0)


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model a server lists at ``/v1/models``: the name its requests must carry."""
    with httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False) as client:
        response = client.get("/v1/models")
        response.raise_for_status()
        data = response.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])
