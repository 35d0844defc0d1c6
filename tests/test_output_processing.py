"""The output processor's per-row work: nothing but the id for requests that need no text per token.

A token-id-only engine (``skip_tokenizer_init``) never calls a detokenizer and
its timeline records no detokenizing time; with a tokenizer, a request that is
not streamed and has no stop strings is decoded once, at its end (``generate``'s
all together once they are all in), and gets the text an incremental stream of
the same tokens gets.
"""

from __future__ import annotations

import pytest

import asyncbatch.llm as llm_module
from asyncbatch.config import SimConfig
from asyncbatch.frontend.detokenizer import DeferredDetokenizer, IncrementalDetokenizer, NullDetokenizer
from asyncbatch.sampling_params import SamplingParams

SIM = SimConfig(step_fixed_ms=0.05, per_token_us=0.0, per_context_token_ns=0.0, output_len_min=4, output_len_max=30)
PROMPTS = [[300 + i, 400 + i, 500 + i] for i in range(12)]


@pytest.fixture
def detok_calls(monkeypatch) -> dict[str, int]:
    """Counts calls of every detokenizer method the output processor could make."""
    calls: dict[str, int] = {}

    def spy(cls, name: str) -> None:
        real = getattr(cls, name)

        def counted(self, *args, **kwargs):
            key = f"{cls.__name__}.{name}"
            calls[key] = calls.get(key, 0) + 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)

    for cls, names in ((NullDetokenizer, ("push", "finish")), (IncrementalDetokenizer, ("push", "finish", "decode_once")),
                       (DeferredDetokenizer, ("push", "finish"))):
        for name in names:
            spy(cls, name)
    return calls


def test_a_token_id_only_run_never_calls_the_detokenizer(make_llm, detok_calls) -> None:
    llm = make_llm(device="sim", sim=SIM, skip_tokenizer_init=True, engine_process=False)
    params = [SamplingParams(max_tokens=20, temperature=0.0, seed=i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    streamed = [t for delta in llm.stream(PROMPTS[0], params[0]) for t in delta.token_ids]
    llm.wait_settled(5.0)
    assert detok_calls == {}
    assert all(o.token_ids and o.text == "" for o in outs)
    assert streamed == outs[0].token_ids
    stats = llm.stats()
    assert stats["output_tokens"] == sum(len(o.token_ids) for o in outs) + len(streamed)
    assert stats["detok_ms_per_step"] == 0.0
    assert all(r.detok_ms == 0.0 for r in llm.timeline.window())


@pytest.mark.parametrize("overlap", [True, False])
def test_generate_decodes_its_texts_together_once_every_output_is_in(make_llm, detok_calls, monkeypatch,
                                                                     overlap: bool) -> None:
    """``generate``'s requests are not streamed and have no stop strings: the output thread only collects their
    ids, even at their end (no detokenizer decodes anything), and ``generate`` decodes every
    text in one ``decode_deferred`` call once all outputs are in. A request submitted without
    ``text_by_caller`` (the asyncio API's, the server's) is decoded by the output thread at its end; a streamed
    one token by token; all three get the same text for the same tokens."""
    batches: list[int] = []
    real = llm_module.decode_deferred
    monkeypatch.setattr(llm_module, "decode_deferred", lambda detoks: batches.append(len(detoks)) or real(detoks))
    llm = make_llm(device="sim", sim=SIM, engine_process=False, overlap=overlap)
    params = [SamplingParams(max_tokens=24, temperature=0.0, seed=i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.wait_settled(5.0)
    assert set(detok_calls) <= {"DeferredDetokenizer.push"}  # its last id, if not EOS; no decode, not even at the end
    assert batches == [len(PROMPTS)]
    stats = llm.stats()
    assert stats["generate_detok_texts"] == len(PROMPTS) and stats["generate_detok_ms"] > 0.0
    tokenizer = llm.tokenizer
    for out in outs:
        assert out.text and out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    # Without text_by_caller: decoded once, by the output thread, when the request ends.
    handle = llm.submit([llm.processor.process(PROMPTS[3], params[3])])[0]
    assert handle.wait(30.0).text == outs[3].text and not handle.undecoded
    assert detok_calls["IncrementalDetokenizer.decode_once"] == detok_calls["DeferredDetokenizer.finish"] == 1
    # Streamed: through the incremental detokenizer, the same text.
    deltas = list(llm.stream(PROMPTS[3], params[3]))
    assert detok_calls["IncrementalDetokenizer.push"] > 0
    assert "".join(d.text for d in deltas) == outs[3].text
    assert [t for d in deltas for t in d.token_ids] == outs[3].token_ids
    llm.wait_settled(5.0)
    assert llm.stats()["detok_ms_per_step"] > 0.0
    assert batches == [len(PROMPTS)]


def test_a_text_generate_cannot_decode_fails_that_output_alone(make_llm, monkeypatch) -> None:
    """A batch decode that raises is retried one text at a time: the output whose text cannot be decoded ends in
    ``"error"`` naming the failure (as when the output thread's decode raises), every other keeps its text."""
    llm = make_llm(device="sim", sim=SIM, engine_process=False)
    params = [SamplingParams(max_tokens=24, temperature=0.0, seed=i) for i in range(len(PROMPTS))]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    poison = expected[5].token_ids[0]
    assert all(poison not in o.token_ids for i, o in enumerate(expected) if i != 5)
    real = llm_module.decode_deferred

    def failing(detoks):
        if any(poison in d.ids for d in detoks):
            raise RuntimeError("undecodable")
        return real(detoks)

    monkeypatch.setattr(llm_module, "decode_deferred", failing)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert outs[5].finish_reason == "error" and "undecodable" in outs[5].error and outs[5].text == ""
    for i, (out, ref) in enumerate(zip(outs, expected)):
        if i != 5:
            assert (out.text, out.finish_reason, out.error) == (ref.text, ref.finish_reason, None)


def test_stop_strings_still_end_a_request_that_is_not_streamed(make_llm) -> None:
    llm = make_llm(device="sim", sim=SIM, engine_process=False)
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0.0, seed=1), use_tqdm=False)[0]
    stop = free.text[len(free.text) // 2:][:2]
    if not stop.strip():
        pytest.skip("the pseudo-tokens' text has no usable stop string")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0.0, seed=1, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert free.text.startswith(out.text)


def test_detokenize_false_returns_ids_only_and_runs_no_detokenizer(make_llm, detok_calls) -> None:
    """vLLM's ``SamplingParams.detokenize``: an engine with a tokenizer, a request that wants no text."""
    llm = make_llm(device="sim", sim=SIM, engine_process=False)
    params = [SamplingParams(max_tokens=20, temperature=0.0, seed=i, detokenize=False) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    streamed = list(llm.stream(PROMPTS[0], params[0]))
    assert not {k: v for k, v in detok_calls.items() if not k.startswith("NullDetokenizer")}
    assert all(o.token_ids and o.text == "" for o in outs)
    assert [t for d in streamed for t in d.token_ids] == outs[0].token_ids and all(d.text == "" for d in streamed)
    with_text = llm.generate(PROMPTS, [SamplingParams(max_tokens=20, temperature=0.0, seed=i)
                                       for i in range(len(PROMPTS))], use_tqdm=False)
    assert [o.token_ids for o in with_text] == [o.token_ids for o in outs]
    assert all(o.text for o in with_text)
    with pytest.raises(ValueError, match="stop needs detokenize=True"):
        SamplingParams(stop=["\n"], detokenize=False)
    with pytest.raises(TypeError, match="detokenize must be a bool"):
        SamplingParams(detokenize="no")
