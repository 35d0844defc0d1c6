"""Every front door validates a request once, through the engine's ``InputProcessor``, and nothing after it
validates again: ``LLM`` (generate, stream, chat), ``AsyncLLM``, the HTTP routes, and the cluster's ingress
with its replica (which takes the ingress's validated request as it is).

The two checks are counted where the input processor calls them: the prompt's (``prompt_token_ids``:
tokenization, emptiness, the vocabulary) once per prompt, the request's (``check_fits``: the context and the
KV cache) once per request. A prompt sent as ``n`` choices is checked once and its ``n`` requests once each.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncbatch.frontend import input_processor
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.serve.async_llm import AsyncLLM

SIM = {"device": "sim", "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256}
PARAMS = SamplingParams(max_tokens=3)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM(**SIM)
    yield engine
    engine.close()


@pytest.fixture
def counts(monkeypatch):
    """Calls of the prompt check and of the request check since the test began."""
    calls = {"prompt": 0, "request": 0}

    def counting(kind: str, check):
        def counted(*args, **kwargs):
            calls[kind] += 1
            return check(*args, **kwargs)
        return counted

    monkeypatch.setattr(input_processor, "prompt_token_ids", counting("prompt", input_processor.prompt_token_ids))
    monkeypatch.setattr(input_processor, "check_fits", counting("request", input_processor.check_fits))
    return calls


def test_llm_validates_each_request_once(engine, counts):
    llm = engine.llm
    llm.generate(["Hello there", [1, 2, 3]], PARAMS, use_tqdm=False)
    assert counts == {"prompt": 2, "request": 2}
    list(llm.stream("Hello", PARAMS))
    assert counts == {"prompt": 3, "request": 3}
    llm.chat(CHAT, PARAMS, use_tqdm=False)
    assert counts == {"prompt": 4, "request": 4}


def test_async_llm_validates_each_request_once(engine, counts):
    async def run() -> None:
        async for _ in engine.generate("Hello", PARAMS):
            pass

    asyncio.run(run())
    assert counts == {"prompt": 1, "request": 1}


def test_the_http_routes_validate_each_request_once(engine, counts):
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")
    from asyncbatch.serve.settings import ServeSettings
    from tests.serve_harness import ServerThread, client

    with ServerThread(engine, ServeSettings(("test-model",))) as server, client(server) as http:
        body = {"model": "test-model", "prompt": ["Hello", "there"], "max_tokens": 3, "n": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert counts == {"prompt": 2, "request": 4}  # two prompts, two choices each
        chat = {"model": "test-model", "messages": CHAT, "max_tokens": 3}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert counts == {"prompt": 3, "request": 5}


class _Response:
    """What a Ray Serve streaming call returns, over a replica's ``generate`` in this process."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def __aiter__(self):
        return self._stream

    def cancel(self) -> None:
        pass  # the replica's request runs to its end (three tokens)


class _Handle:
    def __init__(self, replica) -> None:
        self.generate = self
        self._replica = replica

    def options(self, stream: bool) -> _Handle:
        return self

    def remote(self, request) -> _Response:
        return _Response(self._replica.generate(request))


def test_the_cluster_validates_at_the_ingress_only(counts):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[cluster]')")
    from asyncbatch.cluster.deployment import EngineReplica
    from asyncbatch.cluster.frontend import ClusterEngine, FrontendModel
    from asyncbatch.config import EngineConfig
    from asyncbatch.engine.builder import resolve_model

    replica = EngineReplica(None, SIM)
    try:
        resolved = resolve_model(EngineConfig.from_kwargs(**SIM))
        model = FrontendModel(resolved.tokenizer, resolved.spec, replica.info()["usable_tokens"])
        cluster = ClusterEngine(_Handle(replica), model)

        async def run() -> list:
            ids = await cluster.prompt_ids("Hello")
            (request,) = cluster.submit_ids([ids], [PARAMS], ["c-1"], ["Hello"])
            return [delta async for delta in request]

        deltas = asyncio.run(run())
        assert deltas[-1].finish_reason is not None
        assert counts == {"prompt": 1, "request": 1}  # the ingress's; the replica checked nothing again
    finally:
        replica.engine.close()


def test_the_front_doors_speak_the_protocols(engine):
    from asyncbatch.frontend.engine_client import EngineClient
    from asyncbatch.serve.engine_protocol import AsyncEngineClient

    assert isinstance(engine.llm, EngineClient)
    assert isinstance(engine, AsyncEngineClient)
    assert engine.processor is engine.llm.processor
