"""Random well-typed requests with extreme values against the server: no 5xx, the engine keeps serving.

Each body is valid JSON of the right types (pydantic would refuse the rest with a 400 before any of our
code runs), with values at and past every bound: ints up to 2**64, token ids past the vocabulary, schemas
that no grammar can satisfy, regexes the libraries refuse, conflicting constraints, streams with usage.
What must hold for every one: a status below 500; a refusal is an OpenAI error object naming a message;
a stream ends with ``[DONE]``, and an error event in it can only be the caller's own constraints
excluding each other at a token (``constraints_conflict``: found when that token is sampled, after the 200
went out, as ``serve/generation.py`` says), right before ``[DONE]``. After all of them the server is healthy,
no request is left running and the KV cache's accounting is intact. This is how a top_k of 2**63 was found to
take the whole engine down.
Deterministic (fixed seeds), on ``sim`` with n-gram speculation (the most host logic per step).
"""

from __future__ import annotations

import random

import pytest

from asyncbatch.serve.settings import ServeSettings
from tests.serve_harness import client, serving, sse_events, wait_idle

INTS = [0, 1, 2, 5, 20, 21, 100, 300, 49151, 49152, 10**6, 2**31, 2**63 - 1, 2**63, 2**64, -1, -2, -2**63]
FLOATS = [0.0, 1e-9, 0.5, 1.0, 1.5, 2.0, 2.5, 100.0, 1e30, -0.5, -2.0, -100.0]
SCHEMAS = [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}},
           {"type": "string", "maxLength": 3}, {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                                                 "maxItems": 1},
           {"enum": []}, {"type": "object", "required": ["x"]}, {"$ref": "#/nope"}, {"anyOf": []},
           {"type": "string", "pattern": "("}, {"const": {"a": [1, 2]}}, True]
REGEXES = ["a{0}", "(a|b)*c", "\\d{3,2}", "(", "(?=a)b", "\\p{L}+"]
PROMPTS = ["hi", [1, 2, 3], [[1, 2], [3, 4]], ["a", "b"], [49151], [49152], [2**63], "x" * 300]
MESSAGES = [[{"role": "user", "content": "hi"}],
            [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "ok"}],
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]]


def _fields(rng: random.Random, chat: bool) -> dict:
    def i():
        return rng.choice(INTS)

    def f():
        return rng.choice(FLOATS + INTS[:6])

    fields = {
        "max_tokens": i, "temperature": f, "top_p": f, "top_k": i, "min_p": f, "n": i, "seed": i,
        "presence_penalty": f, "frequency_penalty": f, "repetition_penalty": f, "min_tokens": i,
        "truncate_prompt_tokens": i,
        "stop": lambda: rng.choice(["a", ["\n", "x"], ["a"] * 10, "\u0000"]),
        "stop_token_ids": lambda: [rng.choice([0, 2, 49151, 49152, 2**63, -1]) for _ in range(rng.randint(0, 3))],
        "logit_bias": lambda: {str(rng.choice(INTS)): rng.choice(FLOATS) for _ in range(rng.randint(1, 3))},
        "allowed_token_ids": lambda: [rng.choice(INTS) for _ in range(rng.randint(0, 3))],
        "bad_words": lambda: rng.choice([[], ["a"], ["the", " x "], [" "], ["\u0000"]]),
        "add_special_tokens": lambda: rng.random() < 0.5,
        "cache_salt": lambda: rng.choice(["", "tenant", "\u0000" * 3]),
        "priority": lambda: rng.choice([0, 0, 1, -1, 2**40]),
        "ignore_eos": lambda: rng.random() < 0.5, "stream": lambda: rng.random() < 0.5,
        "stream_options": lambda: {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5},
        "guided_json": lambda: rng.choice(SCHEMAS), "guided_regex": lambda: rng.choice(REGEXES),
        "guided_choice": lambda: rng.choice([["a"], ["", "a"], ["\u0000"]]),
        "response_format": lambda: {"type": "json_schema",
                                    "json_schema": {"name": "n", "schema": rng.choice(SCHEMAS)}},
    }
    if chat:
        fields.update({"logprobs": lambda: rng.random() < 0.5, "top_logprobs": i, "max_completion_tokens": i,
                       "tool_choice": lambda: rng.choice(["none", "auto", "required"]),
                       "tools": lambda: [{"type": "function", "function": {
                           "name": rng.choice(["f", "g h", ""]), "parameters": rng.choice(SCHEMAS[:4])}}],
                       "continue_final_message": lambda: rng.random() < 0.5})
    else:
        fields.update({"logprobs": i, "echo": lambda: rng.random() < 0.5, "prompt_logprobs": i, "best_of": i})
    return fields


def random_body(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body: dict = {"model": "m", "max_tokens": rng.choice([1, 4, 16])}
    if chat:
        body["messages"] = rng.choice(MESSAGES)
    else:
        body["prompt"] = rng.choice(PROMPTS)
    fields = _fields(rng, chat)
    for name in rng.sample(sorted(fields), rng.randint(1, 4)):
        body[name] = fields[name]()
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@pytest.fixture(scope="module")
def served():
    with serving(ServeSettings(("m",)), device="sim", max_model_len=512, max_num_seqs=8,
                 max_num_batched_tokens=128, speculative_config={"method": "ngram", "disable_by_batch_size": None},
                 engine_process=False) as pair:
        yield pair


@pytest.mark.parametrize("seed", [0, 1, 2, 12])  # 12: a stream whose guided_choice and bad_words conflict
def test_random_extreme_requests_never_fail_the_server(served, seed):
    server, engine = served
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    with client(server) as http:
        for _ in range(80):
            path, body = random_body(rng)
            response = http.post(path, json=body)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (body, response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and error["type"], (body, error)
            elif body.get("stream"):
                events = sse_events(response)
                assert events and events[-1] == "[DONE]", (body, response.text[-500:])
                errors = [i for i, event in enumerate(events[:-1]) if "error" in event]
                assert errors in ([], [len(events) - 2]), (body, response.text[-500:])
                if errors:
                    error = events[-2]["error"]
                    assert error["code"] == "constraints_conflict" and error["message"], (body, error)
            else:
                assert response.json()["choices"], body
        assert http.get("/health").status_code == 200
    wait_idle(engine)
    engine.llm.check_integrity()
    assert engine.llm.num_free_blocks == engine.llm.num_usable_blocks
    assert statuses.get(200, 0) >= 10 and sum(v for k, v in statuses.items() if k >= 400) >= 20, statuses
