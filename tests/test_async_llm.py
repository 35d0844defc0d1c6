"""``AsyncLLM``: the asyncio API gives the same tokens as ``LLM``, and every way of leaving a stream early
(cancelling the task, breaking the loop, closing the engine) ends the request and frees its KV blocks."""

from __future__ import annotations

import asyncio

import pytest

from asyncbatch import LLM, SamplingParams
from asyncbatch.errors import EngineDeadError
from asyncbatch.outputs import StreamDelta
from asyncbatch.serve.async_llm import AsyncLLM
from asyncbatch.serve.async_stream import merge_deltas

SIM = {"device": "sim", "max_model_len": 512, "max_num_seqs": 32}


def params(i: int, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)


def prompt(i: int) -> list[int]:
    return [1 + i, 2 + i, 3 + i, 4]


@pytest.fixture
def engine():
    engine = AsyncLLM(**SIM)
    yield engine
    engine.close()


def assert_all_blocks_free(engine: AsyncLLM) -> None:
    engine.llm.check_integrity()
    assert engine.num_requests() == (0, 0)


def test_streams_equal_llm_generate(engine: AsyncLLM) -> None:
    async def collect(i: int) -> tuple[list[int], str | None]:
        ids, finish = [], None
        async for delta in engine.generate(prompt(i), params(i), request_id=f"r{i}"):
            ids += delta.token_ids
            finish = delta.finish_reason or finish
            if delta.finish_reason is not None:
                assert delta.output is not None and delta.output.token_ids == ids
        return ids, finish

    async def main():
        return await asyncio.gather(*(collect(i) for i in range(20)))

    results = asyncio.run(main())
    with LLM(**SIM) as llm:
        refs = llm.generate([prompt(i) for i in range(20)], [params(i) for i in range(20)], use_tqdm=False)
    assert [ids for ids, _ in results] == [r.token_ids for r in refs]
    assert {finish for _, finish in results} == {"length"}
    assert_all_blocks_free(engine)


def test_cancelling_the_consumer_aborts(engine: AsyncLLM) -> None:
    async def main():
        started = asyncio.Event()

        async def consume() -> None:
            async for _delta in engine.generate(prompt(0), params(0, max_tokens=400), request_id="long"):
                started.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):
            if engine.num_requests()[0] == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_requests()[0] == 0 and engine.llm.wait_settled(10.0)
        # The request stopped early: finishing it would have emitted its 400 tokens (and emptied the engine too).
        assert (await engine.stats())["output_tokens"] < 400, "the cancelled request ran to its end"

    asyncio.run(main())
    assert_all_blocks_free(engine)


def test_breaking_the_loop_aborts_and_abort_by_id(engine: AsyncLLM) -> None:
    async def main():
        stream = engine.generate(prompt(1), params(1, max_tokens=400), request_id="broken")
        async for _delta in stream:
            break
        await stream.aclose()
        finishes = []
        async for delta in engine.generate(prompt(2), params(2, max_tokens=400), request_id="by-id"):
            if delta.finish_reason is None:
                await engine.abort("by-id")
            else:
                finishes.append(delta.finish_reason)
        assert finishes == ["abort"]
        while engine.num_requests()[0]:
            await asyncio.sleep(0.01)
        assert engine.llm.wait_settled(10.0)
        assert (await engine.stats())["output_tokens"] < 400, "the closed stream's request ran to its end"

    asyncio.run(main())
    assert_all_blocks_free(engine)


def test_bad_input_raises_and_queues_nothing(engine: AsyncLLM) -> None:
    async def main():
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in engine.generate(prompt(0), SamplingParams(max_tokens=10_000)):
                pass
        with pytest.raises(ValueError, match="prompt"):
            await engine.submit([prompt(0), []], [params(0), params(1)], [None, None])
        assert engine.num_requests() == (0, 0)
        with pytest.raises(ValueError, match="already in use"):
            first = engine.generate(prompt(0), params(0, max_tokens=300), request_id="dup")
            await first.__anext__()
            async for _ in engine.generate(prompt(1), params(1), request_id="dup"):
                pass
        await first.aclose()

    asyncio.run(main())


def test_closing_the_engine_fails_waiting_streams() -> None:
    engine = AsyncLLM(**SIM)

    async def main():
        stream = engine.generate(prompt(0), params(0, max_tokens=400))
        await stream.__anext__()
        engine.close()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_merge_deltas_keeps_every_token_and_the_last_finish() -> None:
    deltas = [StreamDelta("r", "a", [1]), StreamDelta("r", "", [2]), StreamDelta("r", "bc", [3, 4], "stop", 7)]
    merged = merge_deltas(deltas)
    assert (merged.text, merged.token_ids, merged.finish_reason, merged.stop_reason) == ("abc", [1, 2, 3, 4],
                                                                                         "stop", 7)
    assert merge_deltas(deltas[:1]) is deltas[0]
