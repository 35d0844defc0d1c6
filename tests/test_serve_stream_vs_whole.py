"""A streamed response joined equals the same request answered whole: text, tool calls, logprobs, offsets.

Drawn requests (fixed seed) over both endpoints with what makes a stream more than its text: chat
``logprobs`` / ``top_logprobs``, ``tools`` with every ``tool_choice``, ``response_format`` (a schema of the
catalogue, ``json_object``), completions ``logprobs`` with and without ``echo``, ``guided_regex``,
``min_tokens``, ``logit_bias``; seeded, so both answers sample the same tokens. On ``sim`` with the default
model's tokenizer (49,152 tokens, byte-fallback pieces that split characters) and n-gram speculation, so a
delta may carry several tokens and the detokenizer may hold a chunk's text back.
"""

from __future__ import annotations

import json
import random

import pytest
from harness.structured_cases import CASES

from asyncbatch.serve.settings import ServeSettings
from tests.serve_harness import client, serving, sse_events

pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (pip install .[structured])")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]
SCHEMAS = [c.params.json for c in CASES if isinstance(c.params.json, dict)]


@pytest.fixture(scope="module")
def served():
    with serving(ServeSettings(("m",)), device="sim", max_num_seqs=8, engine_process=False,
                 speculative_config={"method": "ngram", "disable_by_batch_size": None}) as pair:
        yield pair


def draw(rng: random.Random) -> tuple[str, dict]:
    body: dict = {"model": "m", "max_tokens": rng.randint(1, 60), "seed": rng.randint(0, 10**6),
                  "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.6:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "weather in Paris?", "add 2 and 3"])}]
        if rng.random() < 0.4:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 1, 5]))
        kind = rng.random()
        if kind < 0.3:
            body.update(tools=TOOLS, tool_choice=rng.choice(["auto", "required", "none",
                                                             {"type": "function", "function": {"name": "add"}}]))
        elif kind < 0.55:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": rng.choice(SCHEMAS)}}
        elif kind < 0.65:
            body["response_format"] = {"type": "json_object"}
        path = "/v1/chat/completions"
    else:
        body["prompt"] = rng.choice(["The capital of", "1, 2, 3,", "def f(x):", "Ünïcödé: 日本"])
        if rng.random() < 0.5:
            body["logprobs"] = rng.choice([0, 1, 3])
        if rng.random() < 0.4:
            body["echo"] = True
        if rng.random() < 0.2:
            body["guided_regex"] = "[a-z]{1,8}"
        path = "/v1/completions"
    if rng.random() < 0.2:
        body["min_tokens"] = min(body["max_tokens"], 3)
    if rng.random() < 0.2:
        body["logit_bias"] = {str(rng.randint(0, 49151)): rng.uniform(-100, 100)}
    return path, body


def whole_chat(choice: dict) -> tuple:
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return message.get("content") or "", calls, (choice.get("logprobs") or {}).get("content") or [], \
        choice["finish_reason"]


def joined_chat(events: list[dict]) -> tuple:
    content, calls, logprobs, finish = "", {}, [], None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], ["", ""])
                slot[0] += (call.get("function") or {}).get("name") or ""
                slot[1] += (call.get("function") or {}).get("arguments") or ""
            logprobs += (choice.get("logprobs") or {}).get("content") or []
            finish = choice.get("finish_reason") or finish
    return content, [tuple(calls[k]) for k in sorted(calls)], logprobs, finish


def whole_completion(choice: dict) -> tuple:
    lp = choice["logprobs"] or {}
    return choice["text"], lp.get("tokens"), lp.get("token_logprobs"), lp.get("text_offset"), choice["finish_reason"]


def joined_completion(events: list[dict]) -> tuple:
    text, tokens, values, offsets, finish, any_lp = "", [], [], [], None, False
    for event in events:
        for choice in event["choices"]:
            text += choice["text"]
            if choice["logprobs"] is not None:
                any_lp = True
                tokens += choice["logprobs"]["tokens"]
                values += choice["logprobs"]["token_logprobs"]
                offsets += choice["logprobs"]["text_offset"]
            finish = choice.get("finish_reason") or finish
    return (text, *((tokens, values, offsets) if any_lp else (None, None, None)), finish)


def test_every_drawn_request_streams_what_it_answers_whole(served):
    server, _engine = served
    rng = random.Random(5)
    seen = {"tool_calls": 0, "chat_logprobs": 0, "echo_logprobs": 0, "offsets": 0}
    with client(server) as http:
        for _ in range(60):
            path, body = draw(rng)
            whole = http.post(path, json=body)
            assert whole.status_code == 200, (body, whole.text[:300])
            with http.stream("POST", path, json={**body, "stream": True}) as response:
                assert response.status_code == 200, body
                events = sse_events(response)
            assert events[-1] == "[DONE]", body
            choice = whole.json()["choices"][0]
            if path.endswith("chat/completions"):
                expected, got = whole_chat(choice), joined_chat(events[:-1])
                seen["tool_calls"] += bool(expected[1])
                seen["chat_logprobs"] += bool(expected[2])
            else:
                expected, got = whole_completion(choice), joined_completion(events[:-1])
                seen["echo_logprobs"] += bool(body.get("echo") and "logprobs" in body)
                seen["offsets"] += bool(expected[3])
            assert got == expected, json.dumps(body)
    assert all(count >= 2 for count in seen.values()), seen


def test_the_joins_see_a_difference():
    """The comparison is not vacuous: a chunk's missing token or offset shows."""
    chunk = {"choices": [{"text": "ab", "finish_reason": "length",
                          "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "text_offset": [0, 1]}}]}
    whole = {"text": "ab", "finish_reason": "length",
             "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "text_offset": [0, 1]}}
    assert joined_completion([chunk]) == whole_completion(whole)
    shifted = json.loads(json.dumps(chunk))
    shifted["choices"][0]["logprobs"]["text_offset"] = [0, 2]
    assert joined_completion([shifted]) != whole_completion(whole)
    call = {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "add", "arguments": "{}"}}]},
                         "finish_reason": "tool_calls"}]}
    message = {"message": {"content": None, "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]},
               "finish_reason": "tool_calls"}
    assert joined_chat([call]) == whole_chat(message)
    assert joined_chat([call]) != whole_chat({**message, "message": {"content": None, "tool_calls": []}})
