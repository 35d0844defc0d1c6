"""``SamplingParams.n`` (vLLM's parallel sampling) and ``RequestOutput.outputs`` (vLLM's per-completion list).

Completion ``i`` of a seeded request is the request seeded ``seed + i`` (the server's rule for ``n`` too), so
each completion is checked against a separate ``n == 1`` run; greedy completions against transformers' greedy
tokens. Every engine test runs in overlap and in synchronous mode.
"""

from __future__ import annotations

import math

import pytest
from engine_checks import assert_idle_and_clean
from reference import logits_at
from tiny_models import EOS_ID, save_tiny_model
from transformers import AutoModelForCausalLM

from asyncbatch import LLM, CompletionOutput, SamplingParams
from asyncbatch.sampling_params import MAX_N

PROMPTS = [[5, 9, 44, 17, 3], [120, 7, 7, 31]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM")


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync"])
def engine(request, tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", overlap=request.param, engine_process=False,
              max_num_batched_tokens=32, max_num_seqs=8, block_size=4, num_threads=1, debug_check_integrity=True)
    yield llm
    llm.close()


def test_seeded_completions_are_the_requests_seeded_seed_plus_index(engine):
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=10, ignore_eos=True)
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        assert [c.index for c in out.outputs] == [0, 1, 2]
        alone = [engine.generate([prompt], SamplingParams(seed=7 + i, temperature=1.0, max_tokens=10,
                                                          ignore_eos=True), use_tqdm=False)[0]
                 for i in range(3)]
        assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three samples of 10 tokens all alike"
        assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in out.outputs)
    assert_idle_and_clean(engine)


def test_unseeded_completions_differ_and_the_flat_fields_are_the_first(engine):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True)
    (out,) = engine.generate([PROMPTS[0]], params, use_tqdm=False)
    completions = out.outputs
    assert len(completions) == 4 and all(isinstance(c, CompletionOutput) for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1
    first = completions[0]
    assert (first.index, first.token_ids, first.finish_reason, first.stop_reason) == (
        0, out.token_ids, out.finish_reason, out.stop_reason)
    assert first.cumulative_logprob is None and first.logprobs is None  # not asked for (vLLM's rule)


def test_greedy_completions_all_equal_transformers(engine, tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype="float32").eval()
    expected = []
    for _ in range(6):
        logits = logits_at(model, PROMPTS[1] + expected)[-1]
        expected.append(int(logits.argmax()))
        if expected[-1] == EOS_ID:
            break
    (out,) = engine.generate([PROMPTS[1]], SamplingParams(n=2, temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [expected, expected]


def test_cumulative_logprob_sums_each_completions_logprobs(engine):
    params = SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=2)
    (out,) = engine.generate([PROMPTS[0]], params, use_tqdm=False)
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        assert completion.logprobs.token_ids == completion.token_ids
        assert completion.cumulative_logprob == pytest.approx(math.fsum(completion.logprobs.logprobs))
        assert completion.cumulative_logprob < 0
    assert out.outputs[0].logprobs is out.logprobs


def test_metrics_span_every_completion(engine):
    (out,) = engine.generate([PROMPTS[0]], SamplingParams(n=3, max_tokens=4, ignore_eos=True), use_tqdm=False)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.latency >= m.ttft > 0


def test_n_is_refused_where_one_completion_is_submitted_and_the_engine_serves_on(engine):
    """``submit`` takes one completion a request (``stream`` and ``generate`` split ``n`` into them)."""
    with pytest.raises(ValueError, match=r"SamplingParams\.n must be 1"):
        engine.submit([engine.processor.process(PROMPTS[0], SamplingParams(n=2, max_tokens=4))])
    assert_idle_and_clean(engine)
    (out,) = engine.generate([PROMPTS[0]], SamplingParams(n=1, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs) == 1 and len(out.token_ids) == 4


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (MAX_N + 1, ValueError), (1.5, TypeError),
                                              (True, TypeError)])
def test_bad_n_names_the_field(value, error):
    with pytest.raises(error, match=r"SamplingParams\.n"):
        SamplingParams(n=value)


def test_a_bad_prompt_among_n_completions_submits_nothing(engine):
    with pytest.raises(ValueError):
        engine.generate([PROMPTS[0], [10**6]], SamplingParams(n=3, max_tokens=4), use_tqdm=False)
    assert engine.num_requests() == (0, 0)
    assert_idle_and_clean(engine)


def test_the_completions_compute_their_prompt_once(engine):
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks of 4 before the block of its last token
    before = engine.prefix_cache_stats()
    (out,) = engine.generate([prompt], SamplingParams(n=3, seed=1, max_tokens=3, ignore_eos=True), use_tqdm=False)
    after = engine.prefix_cache_stats()
    assert len(out.outputs) == 3
    # The first computes the prompt; the other two wait a step and reuse its 3 blocks each.
    assert after["cached_tokens"] - before["cached_tokens"] == 2 * 12
    assert after["deferred_admissions"] - before["deferred_admissions"] == 2
    assert_idle_and_clean(engine)
