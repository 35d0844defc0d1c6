"""The output processor's per-row work: nothing but the id for requests that need no text per token.

A token-id-only engine (``skip_tokenizer_init``) never calls a detokenizer and
its timeline records no detokenizing time; with a tokenizer, a request that is
not streamed and has no stop strings is decoded once, at its end, and gets the
text an incremental stream of the same tokens gets.
"""

from __future__ import annotations

import pytest

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


def test_text_is_decoded_once_at_the_end_unless_streamed(make_llm, detok_calls) -> None:
    llm = make_llm(device="sim", sim=SIM, engine_process=False)
    params = [SamplingParams(max_tokens=24, temperature=0.0, seed=i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert detok_calls.get("IncrementalDetokenizer.push", 0) == 0  # no per-token step for generate()
    assert detok_calls["IncrementalDetokenizer.decode_once"] == len(PROMPTS)
    tokenizer = llm.tokenizer
    for out in outs:
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    # The same request streamed goes through the incremental detokenizer and gets the same text.
    deltas = list(llm.stream(PROMPTS[3], params[3]))
    assert detok_calls["IncrementalDetokenizer.push"] > 0
    assert "".join(d.text for d in deltas) == outs[3].text
    assert [t for d in deltas for t in d.token_ids] == outs[3].token_ids
    llm.wait_settled(5.0)
    assert llm.stats()["detok_ms_per_step"] > 0.0


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
