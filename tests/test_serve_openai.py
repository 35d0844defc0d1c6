"""The official ``openai`` client against ``asyncbatch serve`` on the default model: the same greedy tokens
as ``LLM.generate``, streamed text equal to the whole text, and right usage counts."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install -e '.[serve]')")

from asyncbatch import SamplingParams
from asyncbatch.serve.settings import ServeSettings
from tests.serve_harness import serving

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "Here are three colors:"]
CHAT = [{"role": "user", "content": "Name a large river."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served():
    with serving(ServeSettings(("smol", "smollm2-135m")), device="cpu", dtype="float32", max_num_seqs=8, seed=0) as pair:
        yield pair


def greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **extra)


def test_completions_match_generate_and_stream(served) -> None:
    server, engine = served
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    refs = engine.llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, ref in zip(PROMPTS, refs):
        whole = api.completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"return_token_ids": True})
        choice = whole.choices[0]
        assert choice.text == ref.text
        assert choice.model_extra["token_ids"] == ref.token_ids
        assert choice.finish_reason == ref.finish_reason
        assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert whole.usage.completion_tokens == len(ref.token_ids)
        assert whole.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
        assert whole.model == "smol"

        chunks = list(api.completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"return_token_ids": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
        assert text == choice.text
        assert ids == ref.token_ids
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [ref.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_token_id_prompt_and_n(served) -> None:
    server, engine = served
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ref = engine.llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)[0]
    out = api.completions.create(model="smollm2-135m", prompt=ref.prompt_token_ids, max_tokens=MAX_TOKENS,
                                 temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.text == ref.text for c in out.choices)
    assert out.usage.completion_tokens == 2 * len(ref.token_ids)
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_matches_llm_chat(served) -> None:
    server, engine = served
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ref = engine.llm.chat(CHAT, greedy(), use_tqdm=False)[0]
    whole = api.chat.completions.create(model="smol", messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                        temperature=0)
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)
    stream = api.chat.completions.create(model="smol", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_strings_match_generate(served) -> None:
    server, engine = served
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=[",", "."])
    ref = engine.llm.generate(PROMPTS[1:], params, use_tqdm=False)[0]
    out = api.completions.create(model="smol", prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[",", "."])
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason


def test_async_client_concurrent(served) -> None:
    server, engine = served
    refs = engine.llm.generate(PROMPTS, greedy(), use_tqdm=False)

    async def run() -> tuple[list[str], list[str]]:
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def whole(prompt: str) -> str:
            out = await api.completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            return out.choices[0].text

        async def streamed(prompt: str) -> str:
            stream = await api.completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        wholes = await asyncio.gather(*(whole(p) for p in PROMPTS))
        streams = await asyncio.gather(*(streamed(p) for p in PROMPTS))
        await api.close()
        return wholes, streams

    wholes, streams = asyncio.run(run())
    assert wholes == [r.text for r in refs]
    assert streams == [r.text for r in refs]
    engine.llm.check_integrity()
