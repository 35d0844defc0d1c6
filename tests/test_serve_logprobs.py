"""Log-probabilities, ``logit_bias``, ``min_tokens``, ``allowed_token_ids`` and ``bad_words`` over HTTP.

The formatting (OpenAI's chat and legacy completions objects, ``echo``, vLLM's ``prompt_logprobs``, token
bytes, -inf clamped) without an engine; then a served tiny model (engine core in process: it starts in a
tenth of a second), its numbers checked against transformers' log-softmax of the same weights: the
logprobs are the model's raw distribution, before bias and sampling."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")
openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install -e '.[serve]')")

import torch
from transformers import AutoModelForCausalLM

from asyncbatch.outputs import Logprobs
from asyncbatch.serve.logprobs_format import (
    FLOOR,
    CompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    vllm_prompt_logprobs,
)
from asyncbatch.serve.settings import ServeSettings
from tests.serve_harness import client, serving
from tests.tiny_models import EOS_ID, build_byte_tokenizer, save_tiny_model

TOKENIZER = build_byte_tokenizer()


def ids_of(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


# -- formatting, no engine -----------------------------------------------------------------------------------
def test_token_strings_and_bytes() -> None:
    texts = TokenTexts(TOKENIZER)
    first, second = ids_of("é")  # one character, two byte tokens
    assert texts.get(first) == ("\ufffd", [0xC3]) and texts.get(second) == ("\ufffd", [0xA9])
    assert bytes(texts.get(first)[1] + texts.get(second)[1]).decode() == "é"
    (space_a,) = ids_of(" ")
    assert texts.get(space_a) == (" ", [32])
    assert texts.text(EOS_ID) == "</s>"  # special tokens are shown, not skipped
    assert TokenTexts(None).get(7) == ("token_id:7", list(b"token_id:7"))


def test_chat_object() -> None:
    h, i = ids_of("hi")
    lp = Logprobs([h, i], [-0.5, -math.inf], [1, 3], [[h, i, 5], [h, 5, i]],
                  [[-0.5, -1.0, -2.0], [-0.1, -0.2, -math.inf]])
    out = chat_logprobs(lp, TokenTexts(TOKENIZER), top=2)
    json.dumps(out, allow_nan=False)  # nothing JSON cannot carry
    first, second = out["content"]
    assert first == {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
        {"token": "h", "logprob": -0.5, "bytes": [104]}, {"token": "i", "logprob": -1.0, "bytes": [105]}]}
    assert second["logprob"] == FLOOR and [t["logprob"] for t in second["top_logprobs"]] == [-0.1, -0.2]
    assert chat_logprobs(lp, TokenTexts(TOKENIZER), top=0)["content"][0]["top_logprobs"] == []
    assert chat_logprobs(None, TokenTexts(TOKENIZER), top=2) is None


def test_completions_object_with_echo_and_offsets() -> None:
    a, b, c, d = ids_of("abcd")
    prompt = Logprobs([b], [-1.5], [2], [[c, b]], [[-0.5, -1.5]])  # covers prompt tokens 1.. (b)
    output = Logprobs([c, d], [-0.25, float("nan")], [1, 4], [[c, a], [a, b]], [[-0.25, -3.0], [-0.5, -0.75]])
    out = CompletionLogprobs(TokenTexts(TOKENIZER), top=2).build(output, prompt=([a, b], prompt))
    json.dumps(out, allow_nan=False)
    assert out["tokens"] == ["a", "b", "c", "d"]
    assert out["token_logprobs"] == [None, -1.5, -0.25, FLOOR]
    assert out["top_logprobs"] == [None, {"c": -0.5, "b": -1.5}, {"c": -0.25, "a": -3.0},
                                   {"a": -0.5, "b": -0.75, "d": FLOOR}]  # the sampled token joins the top k
    assert out["text_offset"] == [0, 1, 2, 3]
    later = CompletionLogprobs(TokenTexts(TOKENIZER), top=0, offset=10).build(output)
    assert later["top_logprobs"] == [{"c": -0.25}, {"d": FLOOR}] and later["text_offset"] == [10, 11]


def test_vllm_prompt_logprobs_shape() -> None:
    a, b, c = ids_of("abc")
    lp = Logprobs([b, c], [-1.0, -2.0], [2, 1], [[a, b], [c, a]], [[-0.5, -1.0], [-2.0, -3.0]])
    out = vllm_prompt_logprobs([a, b, c], lp, TokenTexts(TOKENIZER), top=1)
    assert out == [None,
                   {str(a): {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
                    str(b): {"logprob": -1.0, "rank": 2, "decoded_token": "b"}},
                   {str(c): {"logprob": -2.0, "rank": 1, "decoded_token": "c"}}]


# -- a served tiny model against transformers --------------------------------------------------------------------
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
CHAT = [{"role": "user", "content": "Say something."}]
TOL = 2e-3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny"), "LlamaForCausalLM", max_position_embeddings=256)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with serving(ServeSettings(("tiny",)), str(path), device="cpu", dtype="float32", max_num_seqs=4,
                 engine_process=False, chat_template=TEMPLATE) as (server, engine):
        yield server, engine, reference


def model_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """Row ``j``: the model's log-probabilities for the token after ``ids[:j + 1]``."""
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL


def test_completions_echo_logprobs_match_the_model(served) -> None:
    server, _engine, reference = served
    prompt = ids_of("Hello there")
    with client(server) as http:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True,
                "return_token_ids": True, "ignore_eos": True, "n": 2}
        out = http.post("/v1/completions", json=body).json()
    for choice in out["choices"]:
        ids = prompt + choice["token_ids"]
        ref = model_logprobs(reference, ids)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:len(prompt)] == list("Hello there") and choice["text"].startswith("Hello there")
        lengths = [len(t) for t in lp["tokens"]]
        assert lp["text_offset"] == [sum(lengths[:j]) for j in range(len(ids))]
        for j in range(1, len(ids)):
            expected = ref[j - 1, ids[j]].item()
            assert close(lp["token_logprobs"][j], expected), (j, lp["token_logprobs"][j], expected)
            top = lp["top_logprobs"][j]
            assert len(top) <= 4 and close(top[lp["tokens"][j]], expected)
            assert close(max(top.values()), ref[j - 1].max().item())
            if j >= len(prompt):  # greedy: each generated token is the most likely one
                assert close(lp["token_logprobs"][j], ref[j - 1].max().item())


def test_chat_logprobs_match_the_model_whole_and_streamed(served) -> None:
    server, engine, reference = served
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                      top_logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    generated = choice.model_extra["token_ids"]
    ids = engine.processor.chat_prompt_ids(CHAT) + generated
    ref = model_logprobs(reference, ids)
    start = len(ids) - len(generated)
    content = choice.logprobs.content
    assert len(content) == len(generated) == out.usage.completion_tokens
    for k, entry in enumerate(content):
        row = ref[start + k - 1]
        assert close(entry.logprob, row[generated[k]].item())
        assert entry.bytes == TokenTexts(TOKENIZER).get(generated[k])[1]
        values, _ = row.topk(3)
        assert [round(t.logprob, 3) for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=TOL)
        assert close(entry.top_logprobs[0].logprob, entry.logprob)  # greedy
    stream = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3, stream=True, extra_body={"ignore_eos": True,
                                                                                  "return_token_ids": True})
    streamed = []
    for chunk in stream:
        for c in chunk.choices:
            token_ids = c.model_extra.get("token_ids") or []
            entries = c.logprobs.content if c.logprobs is not None else []
            assert len(entries) == len(token_ids)  # each chunk carries its own tokens' logprobs
            streamed += entries
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)
    plain = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_streamed_completion_offsets_run_on(served) -> None:
    """Each chunk's offsets run on over the tokens' strings from the chunk before: the whole response's."""
    server, _engine, _reference = served
    body = {"prompt": "Once", "max_tokens": 10, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    with client(server) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            offsets, tokens = [], []
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                if lp is not None:
                    assert lp["text_offset"][0] == (offsets[-1] + len(tokens[-1]) if offsets else 0)
                    offsets += lp["text_offset"]
                    tokens += lp["tokens"]
    assert len(tokens) == 10 and tokens == whole["tokens"] and offsets == whole["text_offset"]


def test_streamed_echo_with_logprobs_equals_the_whole_response(served) -> None:
    """``echo`` + ``logprobs`` streamed (vLLM serves it): each choice's first chunk brings the prompt's text and
    its tokens (the first unscored), then the generated ones; joined, the same as the response without
    ``stream``."""
    server, _engine, _reference = served
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True, "n": 2,
            "ignore_eos": True}
    with client(server) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"]
        joined = {k: {"text": "", "tokens": [], "token_logprobs": [], "text_offset": [], "chunks": 0} for k in (0, 1)}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                got = joined[choice["index"]]
                if got["chunks"] == 0:  # the prompt first, with its logprobs, the first token's null
                    assert choice["text"].startswith("Hello there")
                    assert choice["logprobs"]["tokens"][:11] == list("Hello there")
                    assert choice["logprobs"]["token_logprobs"][0] is None
                got["chunks"] += 1
                got["text"] += choice["text"]
                if choice["logprobs"] is not None:
                    for key in ("tokens", "token_logprobs", "text_offset"):
                        got[key] += choice["logprobs"][key]
    for k, choice in enumerate(whole):
        got = joined[k]
        assert got["text"] == choice["text"] and got["tokens"] == choice["logprobs"]["tokens"]
        assert got["text_offset"] == choice["logprobs"]["text_offset"]
        assert got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=TOL)


def test_vllm_prompt_logprobs_field(served) -> None:
    server, engine, reference = served
    prompt = ids_of("Hi you")
    ref = model_logprobs(reference, prompt)
    with client(server) as http:
        out = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}).json()
        chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}).json()
    entries = out["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for j in range(1, len(prompt)):
        own = entries[j][str(prompt[j])]
        assert close(own["logprob"], ref[j - 1, prompt[j]].item()) and own["decoded_token"] == "Hi you"[j]
        assert own["rank"] == 1 + int((ref[j - 1] > ref[j - 1, prompt[j]]).sum())
        assert len(entries[j]) <= 3
    chat_ids = engine.processor.chat_prompt_ids(CHAT)
    assert len(chat["prompt_logprobs"]) == len(chat_ids)
    assert all(list(e) == [str(t)] for e, t in zip(chat["prompt_logprobs"][1:], chat_ids[1:]))


def test_logit_bias_and_min_tokens(served) -> None:
    server, _engine, reference = served
    prompt = ids_of("Go")
    (forced,) = ids_of("z")
    with client(server) as http:
        def complete(**fields) -> dict:
            response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                          "return_token_ids": True, **fields})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        biased = complete(logit_bias={str(forced): 100}, logprobs=0)
        assert biased["token_ids"] == [forced] * 5 and biased["text"] == "zzzzz"
        # the logprobs are the model's own, before the bias
        ref = model_logprobs(reference, prompt + biased["token_ids"])
        assert close(biased["logprobs"]["token_logprobs"][0], ref[len(prompt) - 1, forced].item())
        assert biased["logprobs"]["token_logprobs"][0] < -1.0
        greedy = complete(ignore_eos=True)
        banned = complete(logit_bias={str(greedy["token_ids"][0]): -100}, ignore_eos=True)
        assert banned["token_ids"][0] != greedy["token_ids"][0]
        assert complete(logit_bias={str(EOS_ID): 100})["token_ids"] == [EOS_ID]
        held = complete(logit_bias={str(EOS_ID): 100}, min_tokens=3)
        assert len(held["token_ids"]) == 4 and held["token_ids"][3] == EOS_ID and EOS_ID not in held["token_ids"][:3]
        assert held["finish_reason"] == "stop"
        chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "temperature": 0,
                                                       "logit_bias": {str(forced): 100}}).json()
        assert chat["choices"][0]["message"]["content"] == "zzz"


def test_allowed_token_ids_and_bad_words(served) -> None:
    """vLLM's extras: the completion keeps inside ``allowed_token_ids``; a ``bad_words`` word the plain
    completion contains is gone, in the chat route too (the same masks as structured output)."""
    server, _engine, _reference = served
    prompt = ids_of("Go")
    allowed = ids_of("xyz")
    with client(server) as http:
        def complete(path: str = "/v1/completions", **fields) -> dict:
            body = {"prompt": prompt} if "chat" not in path else {"messages": CHAT}
            response = http.post(path, json={**body, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                             "return_token_ids": True, **fields})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        inside = complete(allowed_token_ids=allowed, temperature=1.0, seed=3)
        assert set(inside["token_ids"]) <= set(allowed) and len(inside["token_ids"]) == 12
        for path in ("/v1/completions", "/v1/chat/completions"):
            plain = complete(path)
            text = plain["text"] if "chat" not in path else plain["message"]["content"]
            word = next(text[i:i + 2] for i in range(len(text) - 1)  # whole characters the tokenizer round-trips
                        if all(c.isascii() and c.isprintable() and not c.isspace() for c in text[i:i + 2]))
            banned = complete(path, bad_words=[word])
            banned_text = banned["text"] if "chat" not in path else banned["message"]["content"]
            assert word.strip() not in banned_text and banned_text != text, (word, text, banned_text)
        # constraints that exclude each other: the caller's error (400), streamed or not; the server serves on
        conflict = {"prompt": prompt, "max_tokens": 4, "allowed_token_ids": allowed[:1], "bad_words": ["x"]}
        response = http.post("/v1/completions", json=conflict)
        assert response.status_code == 400 and response.json()["error"]["code"] == "constraints_conflict"
        streamed = http.post("/v1/completions", json={**conflict, "stream": True})
        assert streamed.status_code == 200 and '"constraints_conflict"' in streamed.text
        assert complete(allowed_token_ids=allowed)["token_ids"]


def test_cache_salt_over_http(served) -> None:
    """vLLM's ``cache_salt`` field reaches the prefix cache: a long prompt sent again under another salt computes
    every block again, under its own salt it hits (the engine's counters); tokens are the same."""
    server, engine, _reference = served
    prompt = ids_of("The same long prompt, sent by two tenants. " * 3)
    with client(server) as http:
        def cached(salt: str) -> tuple[int, list[int]]:
            before = engine.prefix_cache_stats()["cached_tokens"]
            response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                          "return_token_ids": True, "cache_salt": salt})
            assert response.status_code == 200, response.text
            return engine.prefix_cache_stats()["cached_tokens"] - before, response.json()["choices"][0]["token_ids"]

        _, tokens = cached("tenant-a")  # tenant-a's blocks are cached now
        assert cached("tenant-b") == (0, tokens)
        again, same = cached("tenant-a")
        assert again > 0 and same == tokens


BAD = [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": 9}, "min_tokens"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"allowed_token_ids": [5, 100000]}, "allowed_token_ids"),
    ("/v1/completions", {"bad_words": [" "]}, "bad_words"),
    ("/v1/chat/completions", {"cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"priority": 1}, "priority"),  # the server's policy is FCFS: only 0
    ("/v1/chat/completions", {"priority": 2**40}, "priority"),
]


def test_bad_values_then_good(served) -> None:
    server, _engine, _reference = served
    base = {"/v1/completions": {"prompt": "x", "max_tokens": 4},
            "/v1/chat/completions": {"messages": CHAT, "max_tokens": 4}}
    with client(server) as http:
        for path, fields, param in BAD:
            response = http.post(path, json={**base[path], **fields})
            assert response.status_code == 400, (fields, response.text)
            error = response.json()["error"]
            assert error["param"] == param and param in error["message"], (fields, error)
        for path, body in base.items():
            ok = http.post(path, json={**body, "ignore_eos": True, "logprobs": True if "chat" in path else 1})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
