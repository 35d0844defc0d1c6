"""Streaming ``n > 1`` completions (vLLM's ``AsyncLLM`` does): ``LLM.stream`` and ``AsyncLLM.generate`` interleave
the completions' deltas, each with its ``index`` and the stream's ``request_id``, and give the tokens
``LLM.generate`` gives the same request; ``abort(request_id)``, or leaving the loop early, ends every completion
and frees its blocks. ``sim`` with seeded sampling, in overlap and synchronous mode."""

from __future__ import annotations

import asyncio

import pytest
from engine_checks import assert_idle_and_clean, wait_all_ended

from asyncbatch import LLM, SamplingParams
from asyncbatch.config import SimConfig
from asyncbatch.serve.async_llm import AsyncLLM

SIM = {"device": "sim", "max_model_len": 512, "max_num_seqs": 8, "debug_check_integrity": True}
PROMPT = [5, 6, 7, 8, 9]
PARAMS = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)


def by_index(deltas, n: int) -> tuple[list[list[int]], list[str], list[list[str]]]:
    """Each completion's tokens and text, and its finish reasons, from an interleaved stream."""
    tokens, texts, finishes = [[] for _ in range(n)], [""] * n, [[] for _ in range(n)]
    for delta in deltas:
        tokens[delta.index] += delta.token_ids
        texts[delta.index] += delta.text
        if delta.finish_reason is not None:
            finishes[delta.index].append(delta.finish_reason)
            assert delta.output is not None and delta.output.request_id == f"{delta.request_id}-{delta.index}"
            assert delta.output.token_ids == tokens[delta.index]
    return tokens, texts, finishes


def wait_idle(llm: LLM, within_s: float = 10.0) -> None:
    wait_all_ended(llm, within_s)
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_stream_interleaves_the_completions_of_generate(make_llm, overlap):
    llm = make_llm(overlap=overlap, **SIM)
    whole = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    deltas = list(llm.stream(PROMPT, PARAMS, request_id="s1"))
    assert {d.request_id for d in deltas} == {"s1"} and {d.index for d in deltas} == {0, 1, 2}
    tokens, texts, finishes = by_index(deltas, 3)
    assert tokens == [c.token_ids for c in whole.outputs]
    assert texts == [c.text for c in whole.outputs]
    assert finishes == [["length"]] * 3
    assert len(set(map(tuple, tokens))) == 3  # seeded apart: three different completions
    # One completion streams as before: index 0, its own id.
    single = list(llm.stream(PROMPT, SamplingParams(max_tokens=4, seed=1, temperature=1.0), request_id="s2"))
    assert {(d.request_id, d.index) for d in single} == {("s2", 0)}
    wait_idle(llm)


def test_abort_by_the_streams_id_ends_every_completion_and_leaving_early_too(make_llm):
    llm = make_llm(**SIM, sim=SimConfig(step_fixed_ms=5.0))
    long = SamplingParams(n=2, max_tokens=400, temperature=1.0, seed=3, ignore_eos=True)
    seen = []
    for delta in llm.stream(PROMPT, long, request_id="s3"):
        seen.append(delta)
        if len(seen) == 2:
            llm.abort("s3")
    tokens, _, finishes = by_index(seen, 2)
    assert finishes == [["abort"], ["abort"]] and all(len(t) < 400 for t in tokens)
    wait_idle(llm)

    before = llm.stats()["output_tokens"]
    stream = llm.stream(PROMPT, long)  # no id given: one is made for the stream
    first = next(stream)
    assert first.request_id.startswith("req-")
    stream.close()  # leaving the loop early
    wait_idle(llm)
    assert llm.stats()["output_tokens"] - before < 2 * 400  # both were stopped, not run to their end


def test_a_streams_id_in_use_is_refused(make_llm):
    llm = make_llm(**SIM, sim=SimConfig(step_fixed_ms=5.0))
    long = SamplingParams(n=2, max_tokens=400, seed=3, ignore_eos=True)
    stream = llm.stream(PROMPT, long, request_id="busy")
    next(stream)
    with pytest.raises(ValueError, match="'busy' is already in use"):
        llm.stream(PROMPT, long, request_id="busy")
    with pytest.raises(ValueError, match="'busy-0' is already in use"):
        llm.stream(PROMPT, SamplingParams(max_tokens=2), request_id="busy-0")  # a completion's own id
    stream.close()
    wait_idle(llm)


def test_async_generate_interleaves_the_completions_and_leaving_early_aborts_them():
    engine = AsyncLLM(**SIM, sim=SimConfig(step_fixed_ms=2.0))
    try:
        whole = engine.llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]

        async def main() -> tuple[list, list]:
            deltas = [d async for d in engine.generate(PROMPT, PARAMS, request_id="a1")]
            early = []
            async for delta in engine.generate(PROMPT, SamplingParams(n=2, max_tokens=400, seed=1,
                                                                      ignore_eos=True), request_id="a2"):
                early.append(delta)
                if len(early) == 3:
                    break
            return deltas, early

        before = engine.llm.stats()["output_tokens"]
        deltas, early = asyncio.run(main())
        assert {d.request_id for d in deltas} == {"a1"}
        tokens, texts, finishes = by_index(deltas, 3)
        assert tokens == [c.token_ids for c in whole.outputs] and texts == [c.text for c in whole.outputs]
        assert finishes == [["length"]] * 3
        assert {d.request_id for d in early} == {"a2"}
        wait_idle(engine.llm)
        # a1's 30 tokens, and fewer than a2's 800: leaving the loop stopped both of its completions.
        assert engine.llm.stats()["output_tokens"] - before < 30 + 2 * 400
    finally:
        engine.close()
