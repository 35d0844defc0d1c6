"""``asyncbatch serve`` on the ``sim`` device: every refusal is an OpenAI error object with the right status
and the server goes on; a client that leaves mid-request frees its KV blocks; the queue bound, the API key,
the body limit, token-only engines, and the auxiliary routes."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")

from asyncbatch import SamplingParams
from asyncbatch.config import SimConfig
from asyncbatch.serve.request_stream import RequestStream
from asyncbatch.serve.settings import ServeSettings
from tests.serve_harness import client, serving, sse_events, wait_idle

GOOD = {"model": "test-model", "prompt": [1, 2, 3, 4], "max_tokens": 4, "ignore_eos": True}
SIM = {"device": "sim", "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256}


def metric(text: str, name: str, label: str = "") -> float:
    """The first sample of ``name`` (whose labels include ``label``, if given) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label} not in /metrics")


@pytest.fixture(scope="module")
def served():
    settings = ServeSettings(("test-model", "alias"), max_body_bytes=4096)
    with serving(settings, **SIM) as pair:
        yield pair


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_good(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


BAD_REQUESTS = [
    ("malformed json", {"content": b'{"prompt": [1, 2', "headers": {"content-type": "application/json"}}, 400, None),
    ("unknown field", {"json": {**GOOD, "max_tokenz": 3}}, 400, "max_tokenz"),
    ("wrong type", {"json": {**GOOD, "max_tokens": "many"}}, 400, "max_tokens"),
    ("missing prompt", {"json": {"model": "test-model"}}, 400, "prompt"),
    ("unknown model", {"json": {**GOOD, "model": "gpt-9"}}, 404, "model"),
    ("value out of range", {"json": {**GOOD, "top_p": 1.5}}, 400, "top_p"),
    ("negative max_tokens", {"json": {**GOOD, "max_tokens": -1}}, 400, "max_tokens"),
    ("beyond the context", {"json": {**GOOD, "max_tokens": 300}}, 400, "max_tokens"),
    ("prompt filling the context", {"json": {**GOOD, "prompt": [1] * 256}}, 400, "prompt"),
    ("token id out of vocabulary", {"json": {**GOOD, "prompt": [1, 10**9]}}, 400, None),
    ("empty prompt", {"json": {**GOOD, "prompt": ""}}, 400, None),
    ("logprobs out of range", {"json": {**GOOD, "logprobs": 21}}, 400, "logprobs"),
    ("logit_bias out of range", {"json": {**GOOD, "logit_bias": {"5": 101}}}, 400, "logit_bias"),
    ("logit_bias unknown token", {"json": {**GOOD, "logit_bias": {"100000": 1}}}, 400, "logit_bias"),
    ("bad regex", {"json": {**GOOD, "guided_regex": "(unclosed"}}, 400, "guided_regex"),
    ("n out of range", {"json": {**GOOD, "n": 0}}, 400, "n"),
    ("truncate_prompt_tokens zero", {"json": {**GOOD, "truncate_prompt_tokens": 0}}, 400, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens past the context", {"json": {**GOOD, "truncate_prompt_tokens": 257}}, 400,
     "truncate_prompt_tokens"),
    ("body too large", {"json": {**GOOD, "prompt": [1] * 3000}}, 413, None),
]


@pytest.mark.parametrize(("case", "kwargs", "status", "param"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_then_good(served, case: str, kwargs: dict, status: int, param: str | None) -> None:
    server, _engine = served
    with client(server) as http:
        assert_error(http.post("/v1/completions", **kwargs), status, param)
        assert_good(http)


def test_bad_chat_requests(served) -> None:
    server, _engine = served
    chat = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with client(server) as http:
        assert_error(http.post("/v1/chat/completions", json={**chat, "messages": []}), 400, "messages")
        assert_error(http.post("/v1/chat/completions", json={**chat, "tools": [{"type": "function"}]}), 400, "tools")
        assert_error(http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400, "top_logprobs")
        assert_error(http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 21}), 400,
                     "top_logprobs")
        assert_error(http.post("/v1/chat/completions", json={**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}), 400,
            "response_format")
        assert_error(http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 10_000}), 400)
        ok = http.post("/v1/chat/completions", json=chat)
        assert ok.status_code == 200 and ok.json()["model"] == "test-model"  # an alias answers with the first name
        assert ok.json()["usage"]["completion_tokens"] == 3
        default = http.post("/v1/chat/completions", json={**chat, "max_tokens": None, "ignore_eos": False})
        assert default.status_code == 200, default.text


def test_stream_n_choices_and_usage(served) -> None:
    server, _engine = served
    body = {**GOOD, "n": 3, "max_tokens": 6, "stream": True, "seed": 5, "temperature": 1.0,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    with client(server) as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    ids = {0: [], 1: [], 2: []}
    for event in events[:-2]:
        for choice in event["choices"]:
            ids[choice["index"]] += choice["token_ids"]
    assert all(len(v) == 6 for v in ids.values())
    assert usage == {"prompt_tokens": 4, "completion_tokens": 18, "total_tokens": 22,
                     "prompt_tokens_details": {"cached_tokens": 0}}  # no full block to reuse


def test_streamed_echo_leads_each_choice_with_the_prompt_in_a_chunk_like_the_others(served) -> None:
    """``echo`` with ``stream``: each choice's first chunk is the prompt's text, with the fields every later
    chunk has (``stop_reason``, and ``token_ids`` empty: no completion token yet); then the same text and
    tokens as the whole response."""
    server, _engine = served
    body = {**GOOD, "n": 2, "max_tokens": 5, "seed": 3, "temperature": 1.0, "echo": True, "return_token_ids": True}
    with client(server) as http:
        whole = http.post("/v1/completions", json=body).json()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = sse_events(response)
    assert events[-1] == "[DONE]"
    choices = [choice for event in events[:-1] for choice in event["choices"]]
    assert {frozenset(choice) for choice in choices} == {
        frozenset({"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids"})}
    for expected in whole["choices"]:
        mine = [choice for choice in choices if choice["index"] == expected["index"]]
        prompt_text = mine[0]["text"]
        assert prompt_text and mine[0]["token_ids"] == [] and mine[0]["finish_reason"] is None
        assert expected["text"].startswith(prompt_text)
        assert "".join(choice["text"] for choice in mine) == expected["text"]
        assert [t for choice in mine for t in choice["token_ids"]] == expected["token_ids"]
        assert mine[-1]["finish_reason"] == expected["finish_reason"] == "length"


def test_continuous_usage_counts_the_tokens_streamed_so_far() -> None:
    """``continuous_usage_stats``: every chunk's usage counts the completion tokens sent up to it (vLLM's).

    20 ms steps, so that tokens arrive apart: at the default 2 ms a loaded machine's event loop took each
    choice's five tokens as one merged delta (a CI run), and the count went up only once per choice."""
    body = {**GOOD, "n": 2, "max_tokens": 5, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with (serving(ServeSettings(("test-model",)), **{**SIM, "sim": SimConfig(step_fixed_ms=20.0)}) as (server, _),
          client(server) as http, http.stream("POST", "/v1/completions", json=body) as response):
        assert response.status_code == 200
        events = sse_events(response)
    sent, counts = 0, []
    for event in events[:-2]:
        sent += sum(len(choice["token_ids"]) for choice in event["choices"])
        assert event["usage"] == {"prompt_tokens": 4, "completion_tokens": sent, "total_tokens": 4 + sent}, event
        counts.append(sent)
    assert counts[-1] == 10 and len(set(counts)) > 2  # counted up chunk by chunk, not only at the end
    assert events[-2]["usage"]["completion_tokens"] == 10 and events[-1] == "[DONE]"


def test_openai_nulls_and_bookkeeping_fields_are_taken(served) -> None:
    """OpenAI's schema lets ``n``, ``stream`` and ``echo`` be null, as clients that write out unset fields send;
    its bookkeeping fields are accepted."""
    server, _engine = served
    with client(server) as http:
        response = http.post("/v1/completions", json={**GOOD, "n": None, "stream": None, "echo": None})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 1 and response.json()["usage"]["completion_tokens"] == 4
        chat = http.post("/v1/chat/completions", json={"model": "test-model", "max_tokens": 2, "ignore_eos": True,
                                                       "messages": [{"role": "user", "content": "hi"}],
                                                       "n": None, "stream": None})
        assert chat.status_code == 200, chat.text
        assert len(chat.json()["choices"]) == 1
        assert_error(http.post("/v1/completions", json={**GOOD, "n": "two"}), 400, "n")
        # OpenAI's bookkeeping fields, which clients and frameworks send, are taken and change nothing.
        kept = http.post("/v1/completions", json={**GOOD, "store": False, "metadata": {"job": "eval"}, "user": "u",
                                                  "service_tier": "auto", "prompt_cache_key": "k",
                                                  "safety_identifier": "s"})
        assert kept.status_code == 200 and kept.json()["usage"]["completion_tokens"] == 4, kept.text


def test_every_refusal_is_counted_by_status(served) -> None:
    """``requests_rejected_total{status}`` counts each answer that refused a request: the schema's and the
    values' 400s, an unknown model's and route's 404s (and the guard's 401 / 413, tested with it)."""
    server, _engine = served

    def rejected(http: httpx.Client, status: int) -> float:
        try:
            return metric(http.get("/metrics").text, "asyncbatch:requests_rejected_total", f'status="{status}"')
        except AssertionError:  # no refusal of that status yet: no series
            return 0.0

    with client(server) as http:
        before = {status: rejected(http, status) for status in (400, 404)}
        assert_error(http.post("/v1/completions", json={**GOOD, "max_tokenz": 3}), 400, "max_tokenz")
        assert_error(http.post("/v1/completions", json={**GOOD, "temperature": -1}), 400, "temperature")
        assert_error(http.post("/v1/completions", json={**GOOD, "model": "nope"}), 404, "model")
        assert http.get("/v1/nowhere").status_code == 404
        assert_good(http)
        assert rejected(http, 400) == before[400] + 2 and rejected(http, 404) == before[404] + 2


def test_disconnect_mid_stream_frees_blocks(served) -> None:
    server, engine = served
    body = {**GOOD, "max_tokens": 200, "stream": True}
    with client(server) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
        wait_idle(engine)
        engine.llm.check_integrity()
        metrics = http.get("/metrics").text
        assert metric(metrics, "asyncbatch:kv_cache_usage_perc") == 0.0
        assert metric(metrics, "asyncbatch:request_success_total", 'finished_reason="abort"') >= 1
        assert_good(http)


def test_disconnect_while_waiting_for_whole_response(served) -> None:
    server, engine = served
    with client(server) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**GOOD, "max_tokens": 240}, timeout=0.3)
        wait_idle(engine)
        engine.llm.check_integrity()
        assert_good(http)


def test_routes_tokenize_models_health_version(served) -> None:
    server, engine = served
    with client(server) as http:
        ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert ids["tokens"] == engine.tokenizer.encode("Hello world") and ids["count"] == len(ids["tokens"])
        text = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
        assert text == engine.tokenizer.decode(ids["tokens"])
        assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
        chat_ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert chat_ids == engine.llm.chat_prompt_ids([{"role": "user", "content": "hi"}])
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["test-model", "alias"]
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/version").json()["version"]
        assert_error(http.get("/v1/nothing"), 404)


def test_continue_final_message_continues_the_assistants_start(served) -> None:
    """vLLM's ``continue_final_message``: the last message (the start of the assistant's answer) is left open, so
    the prompt ends with its text and the model continues it; with ``add_generation_prompt`` too it is a 400
    naming the field (a ``ValueError`` in the Python API)."""
    server, engine = served
    messages = [{"role": "user", "content": "Greet me"}, {"role": "assistant", "content": "Hello, my name is"}]
    closed = engine.llm.chat_prompt_ids(messages, add_generation_prompt=False)
    opened = engine.llm.chat_prompt_ids(messages, add_generation_prompt=False, continue_final_message=True)
    assert engine.tokenizer.decode(opened).endswith("Hello, my name is")
    assert len(opened) < len(closed) and closed[:len(opened)] == opened  # the end of turn is what is left off
    with pytest.raises(ValueError, match="continue_final_message"):
        engine.llm.chat_prompt_ids(messages, add_generation_prompt=True, continue_final_message=True)
    with client(server) as http:
        body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
        assert http.post("/tokenize", json=body).json()["tokens"] == opened
        reply = http.post("/v1/chat/completions", json={**body, "model": "test-model", "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(opened)
        assert_error(http.post("/v1/chat/completions", json={**body, "model": "test-model", "max_tokens": 3,
                                                              "add_generation_prompt": True}),
                     400, "continue_final_message")
        # The same switches through chat_template_kwargs (they win over the fields, as in vLLM).
        through_kwargs = {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False,
                                                                         "continue_final_message": True}}
        assert http.post("/tokenize", json=through_kwargs).json()["tokens"] == opened


def test_truncate_prompt_tokens_keeps_the_prompts_end(served) -> None:
    """vLLM's ``truncate_prompt_tokens`` over HTTP: usage, the returned prompt ids and the echo count the prompt's
    last k tokens only; -1 keeps up to ``max_model_len``; a chat prompt is cut after its template. (That the tokens
    are those of the k tokens sent alone: ``test_bad_input``, on a real model; the sim's tokens say nothing.)"""
    server, engine = served
    prompt = [7 + (i * 13) % 200 for i in range(30)]
    kept = prompt[-5:]
    body = {"model": "test-model", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    with client(server) as http:
        cut = http.post("/v1/completions", json={**body, "prompt": prompt, "truncate_prompt_tokens": 5, "echo": True})
        whole = http.post("/v1/completions", json={**body, "prompt": prompt, "truncate_prompt_tokens": -1})
        for response in (cut, whole):
            assert response.status_code == 200, response.text
        assert cut.json()["usage"]["prompt_tokens"] == 5 and whole.json()["usage"]["prompt_tokens"] == 30
        choice = cut.json()["choices"][0]
        assert choice["prompt_token_ids"] == kept and len(choice["token_ids"]) == 6
        assert choice["text"].startswith(engine.tokenizer.decode(kept))
        assert whole.json()["choices"][0]["prompt_token_ids"] == prompt
        chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 4}).json()[
            "usage"]["prompt_tokens"] == 4
    by_text = engine.llm.generate([engine.tokenizer.decode(prompt)], SamplingParams(max_tokens=2,
                                  truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert len(by_text.prompt_token_ids) == 3 and by_text.prompt == engine.tokenizer.decode(by_text.prompt_token_ids)


def test_metrics_after_requests(served) -> None:
    server, _engine = served
    with client(server) as http:
        before = metric(http.get("/metrics").text, "asyncbatch:generation_tokens_total")
        assert_good(http)
        text = http.get("/metrics").text
    assert metric(text, "asyncbatch:generation_tokens_total") == before + 4
    for name in ("asyncbatch:time_to_first_token_seconds_count", "asyncbatch:e2e_request_latency_seconds_count",
                 "asyncbatch:time_per_output_token_seconds_count", "asyncbatch:device_busy_seconds_total",
                 "asyncbatch:device_span_seconds_total", "asyncbatch:num_requests_running",
                 "asyncbatch:num_requests_waiting", "asyncbatch:device_busy_fraction"):
        assert metric(text, name) >= 0
    assert 0 < metric(text, "asyncbatch:device_busy_seconds_total") <= metric(text, "asyncbatch:device_span_seconds_total")


def test_prefix_cache_figures(served) -> None:
    server, _engine = served
    shared = {**GOOD, "prompt": list(range(100, 164))}  # four full blocks of 16
    with client(server) as http:
        before = http.get("/metrics").text
        for _ in range(2):
            assert http.post("/v1/completions", json=shared).status_code == 200
        after = http.get("/metrics").text
    hits = metric(after, "asyncbatch:prefix_cache_hits_total") - metric(before, "asyncbatch:prefix_cache_hits_total")
    queries = (metric(after, "asyncbatch:prefix_cache_queries_total")
               - metric(before, "asyncbatch:prefix_cache_queries_total"))
    assert queries == 128 and hits >= 48  # the second request reuses at least the first three blocks
    assert 0 < metric(after, "asyncbatch:prefix_cache_hit_rate") <= 1
    assert metric(after, "asyncbatch:prefix_cache_blocks") >= 3


def test_usage_says_how_many_prompt_tokens_came_from_the_cache(served) -> None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: the second of two equal 64-token prompts reuses
    three blocks of 16; with ``n = 2`` the prompt counts once, as in ``prompt_tokens``; streamed, the final usage
    chunk carries it and the continuous per-chunk usage does not."""
    server, _engine = served
    body = {**GOOD, "prompt": list(range(300, 364))}
    with client(server) as http:
        first = http.post("/v1/completions", json=body).json()["usage"]
        second = http.post("/v1/completions", json={**body, "n": 2}).json()["usage"]
        with http.stream("POST", "/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                ) as response:
            events = sse_events(response)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens"] == 64 and second["prompt_tokens_details"] == {"cached_tokens": 48}
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert all("prompt_tokens_details" not in event["usage"] for event in events[:-2])


def test_api_key() -> None:
    with serving(ServeSettings(("m",), api_key="s3cret"), **SIM) as (server, _engine), client(server) as http:
        body = {**GOOD, "model": "m"}
        error = assert_error(http.post("/v1/completions", json=body), 401)
        assert error["type"] == "authentication_error"
        assert_error(http.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert http.get("/health").status_code == 200  # probes stay open
        ok = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_queue_bound_answers_503_with_retry_after() -> None:
    settings = ServeSettings(("m",), max_waiting=2)
    # 20 ms steps: the two running requests (240 tokens) outlast the whole check by seconds
    slow = SimConfig(step_fixed_ms=20.0)
    with serving(settings, **{**SIM, "max_num_seqs": 2, "sim": slow}) as (server, engine):
        long = {**GOOD, "model": "m", "max_tokens": 240, "stream": True}
        responses: list[httpx.Response] = []
        with client(server) as http:
            streams = [http.stream("POST", "/v1/completions", json=long) for _ in range(4)]
            # the first two are scheduled before the next two arrive: until then they count as waiting
            for expected, batch in (((2, 0), streams[:2]), ((4, 2), streams[2:])):
                responses += [stream.__enter__() for stream in batch]
                deadline = time.monotonic() + 30
                while engine.num_requests() != expected and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert engine.num_requests() == expected  # at the end: two running, two waiting
            assert [r.status_code for r in responses] == [200] * 4
            refused = http.post("/v1/completions", json={**GOOD, "model": "m"})
            assert_error(refused, 503)
            assert refused.headers["retry-after"] == "1"
            for stream in streams:
                stream.__exit__(None, None, None)
            wait_idle(engine)
            ok = http.post("/v1/completions", json={**GOOD, "model": "m"})
            assert ok.status_code == 200
        engine.llm.check_integrity()


def test_token_only_engine() -> None:
    with serving(ServeSettings(("m",)), skip_tokenizer_init=True, **SIM) as (server, engine):
        assert engine.tokenizer is None
        with client(server) as http:
            out = http.post("/v1/completions", json={**GOOD, "model": "m"}).json()
            assert len(out["choices"][0]["token_ids"]) == 4 and out["choices"][0]["text"] == ""
            error = assert_error(http.post("/v1/completions", json={**GOOD, "model": "m", "prompt": "text"}), 400)
            assert "skip_tokenizer_init" in error["message"]
            assert_error(http.post("/v1/completions", json={**GOOD, "model": "m", "stop": ["x"]}), 400, "stop")
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            assert_error(http.post("/v1/chat/completions", json=chat), 400)
            assert_error(http.post("/tokenize", json={"prompt": "hi"}), 400)


def test_concurrent_streams_in_threads(served) -> None:
    """Streams from several connections at once each get their own complete sequence."""
    server, engine = served
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        body = {**GOOD, "max_tokens": 20, "stream": True, "seed": i, "return_token_ids": True}
        with client(server) as http, http.stream("POST", "/v1/completions", json=body) as response:
            results[i] = [t for e in sse_events(response)[:-1] for c in e["choices"] for t in c["token_ids"]]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(8)) and all(len(v) == 20 for v in results.values())
    wait_idle(engine)


class _NeverEnding(RequestStream):
    """A choice whose engine never confirms its abort (an engine that stopped)."""

    def __init__(self) -> None:
        super().__init__("never", [1])
        self.aborted = False

    @property
    def output(self):
        return None

    @property
    def finished(self) -> bool:
        return False

    def abort(self) -> None:
        self.aborted = True

    async def final_output(self):
        await asyncio.sleep(3600)

    async def deltas(self):
        yield  # pragma: no cover - never iterated here


def test_an_abandoned_choice_whose_abort_never_comes_is_logged_not_left_raising(monkeypatch, caplog) -> None:
    """A response that stopped reading aborts its choices and awaits their final outputs off its path; when one
    never comes, a warning says so (no "Task exception was never retrieved" from an unawaited task)."""
    from asyncbatch.serve import generation

    monkeypatch.setattr(generation, "ABORT_CONFIRM_S", 0.05)
    choice = _NeverEnding()
    gen = generation.Generation(state=None, response_id="cmpl-x", model="m", requests=[choice], prompt_tokens=1)

    async def abandon() -> list[BaseException | None]:
        gen._record_abandoned()
        tasks = list(generation._background)
        await asyncio.wait(tasks, timeout=5)
        return [t.exception() for t in tasks]

    with caplog.at_level(logging.WARNING, logger="asyncbatch.serve"):
        errors = asyncio.run(abandon())
    assert choice.aborted and errors == [None]
    assert "cmpl-x: choice 0 was abandoned and its abort not confirmed" in caplog.text


def test_a_constraint_without_a_grammar_library_is_a_400_naming_the_field(monkeypatch) -> None:
    """A server installed without the structured extra: a constrained request gets a 400 naming its field and
    what to install (not a 500 with a traceback), and plain requests go on."""
    from asyncbatch.sampling import grammar

    class Missing:
        def __init__(self, *args, **kwargs) -> None:
            raise ImportError("structured outputs need a grammar library; install it with: pip install .[structured]")

    monkeypatch.setattr(grammar, "GrammarCompiler", Missing)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with serving(ServeSettings(("m",)), **SIM) as (server, _engine), client(server) as http:
        for fields, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                              ({"guided_regex": "[a-z]+"}, "guided_regex")):
            error = assert_error(http.post("/v1/chat/completions", json={**chat, **fields}), 400, param)
            assert "pip install .[structured]" in error["message"], error
        response = http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200, response.text


def test_an_internal_error_is_a_500_and_the_connection_serves_on(served, monkeypatch) -> None:
    """The 500 goes out whole and the keep-alive connection stays usable: uvicorn used to close it after the
    app re-raised the answered error, so the client's next request met a reset connection."""
    server, engine = served

    def broken(*args, **kwargs):
        raise RuntimeError("injected internal error")

    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    with client(server) as http:
        for _ in range(3):
            error = assert_error(http.post("/tokenize", json={"prompt": "Hello"}), 500)
            assert "injected internal error" in error["message"]
            assert_good(http)  # the same connection
