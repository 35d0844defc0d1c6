"""``logit_bias`` and ``min_tokens`` against a transformers reference; bad values of the issue's fields.

The reference is greedy decoding spelled out over transformers' float32 logits:
the bias is added to the logits, and while fewer than ``min_tokens`` tokens exist
EOS and the stop token ids are masked out. Every engine test runs in overlap and
in synchronous mode (the count of generated tokens a row's mask depends on is one
step ahead of the host in overlap mode).
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import assert_idle_and_clean
from reference import logits_at
from tiny_models import EOS_ID, TINY_VOCAB, save_tiny_model
from transformers import AutoModelForCausalLM

from asyncbatch import LLM, SamplingParams

TOL = 1e-4  # engine logprobs vs transformers (float32)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype="float32").eval()


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync"])
def engine(request, tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", overlap=request.param, engine_process=False,
              max_num_batched_tokens=16, max_num_seqs=8, block_size=4, num_threads=1, debug_check_integrity=True)
    yield llm
    llm.close()


def reference_greedy(model, prompt: list[int], max_tokens: int, bias: dict | None = None, min_tokens: int = 0,
                     stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False) -> list[int]:
    """Greedy tokens with ``bias`` added to the logits and EOS / ``stop_token_ids`` masked before
    ``min_tokens`` outputs; ends after a stop token (kept, as the engine keeps it) or ``max_tokens``."""
    stops = set(stop_token_ids) | (set() if ignore_eos else {EOS_ID})
    masked = torch.tensor(sorted(set(stop_token_ids) | {EOS_ID}))
    out: list[int] = []
    while len(out) < max_tokens:
        logits = logits_at(model, prompt + out)[-1]
        for token, value in (bias or {}).items():
            logits[int(token)] += value
        if len(out) < min_tokens:
            logits[masked] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            break
    return out


def top_tokens(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    values, ids = logits_at(model, prompt)[-1].topk(n)
    return ids.tolist(), values.tolist()


def prompt_of(i: int, n: int) -> list[int]:
    return [3 + (i * 41 + j * 13) % 290 for j in range(n)]


def assert_raw_logprobs(model, out, k: int) -> None:
    """``out.logprobs`` are of the raw distribution (no bias, no mask): values, ranks and top ids."""
    p = len(out.prompt_token_ids)
    assert out.logprobs.token_ids == out.token_ids and len(out.logprobs.ranks) == len(out.token_ids)
    raw = torch.log_softmax(logits_at(model, out.prompt_token_ids + out.token_ids), dim=-1)  # [len, V]
    for i, token in enumerate(out.token_ids):
        row = raw[p - 1 + i]
        chosen = float(row[token])
        assert abs(out.logprobs.logprobs[i] - chosen) <= TOL, (i, out.logprobs.logprobs[i], chosen)
        assert 1 + int((row > chosen + TOL).sum()) <= out.logprobs.ranks[i] <= int((row >= chosen - TOL).sum())
        best = row.topk(k).values.tolist()
        assert all(abs(a - b) <= TOL for a, b in zip(out.logprobs.top_logprobs[i], best)), (i, best)
        assert len(out.logprobs.top_token_ids[i]) == k
        assert [float(row[t]) for t in out.logprobs.top_token_ids[i]] == pytest.approx(best, abs=TOL)


# -- logit_bias ----------------------------------------------------------------------------------------------


def test_positive_bias_forces_the_token_and_leaves_logprobs_raw(engine, reference):
    prompts = [prompt_of(0, 12), prompt_of(1, 30), prompt_of(2, 5)]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={77: 100.0}, logprobs=3),
        SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True, logit_bias={"150": 100},
                       logprobs=2),  # string key, as OpenAI sends it; random sampling too
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3),  # same batch, no bias
    ]
    forced, sampled, plain = engine.generate(prompts, params, use_tqdm=False)
    assert forced.token_ids == [77] * 8
    assert sampled.token_ids == [150] * 8
    assert plain.token_ids == reference_greedy(reference, prompts[2], 8, ignore_eos=True)
    for out, p in ((forced, params[0]), (sampled, params[1]), (plain, params[2])):
        assert_raw_logprobs(reference, out, p.logprobs)
    # the bias made a token the raw model does not favour: its reported logprob is the raw one, far from 0
    assert max(forced.logprobs.ranks) > 1 and min(forced.logprobs.logprobs) < -1.0
    assert_idle_and_clean(engine)


def test_negative_bias_on_the_argmax_picks_the_runner_up(engine, reference):
    prompts = [prompt_of(i, 6 + 9 * i) for i in range(5)]
    expected, biases = [], []
    for prompt in prompts:
        (best, runner_up, _), (_, v2, v3) = top_tokens(reference, prompt, 3)
        assert v2 - v3 > 10 * TOL, "no near-tie between runner-up and third place"
        expected.append(runner_up)
        biases.append({best: -100.0})
    params = [SamplingParams(max_tokens=1, temperature=0.0, logit_bias=b) for b in biases]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [[t] for t in expected]
    assert_idle_and_clean(engine)


def test_bias_values_match_the_biased_reference(engine, reference):
    """Moderate biases change some greedy choices (not all): the engine adds exactly the given values."""
    prompts = [prompt_of(10 + i, 4 + 7 * i) for i in range(4)]
    biases = [
        {t: 1.5 for t in range(100, 140)},
        {t: -2.0 for t in range(3, 300, 3)} | {"42": 3.25},
        {5: 0.75, 250: -0.5, 99: 2.5},
        None,
    ]
    params = [SamplingParams(max_tokens=10, temperature=0.0, logit_bias=b, ignore_eos=True) for b in biases]
    outs = engine.generate(prompts, params, use_tqdm=False)
    changed = 0
    for prompt, bias, out in zip(prompts, biases, outs):
        norm = {int(k): v for k, v in (bias or {}).items()}
        assert out.token_ids == reference_greedy(reference, prompt, 10, norm, ignore_eos=True)
        changed += out.token_ids != reference_greedy(reference, prompt, 10, ignore_eos=True)
    assert changed >= 2, "the biases were meant to change some requests' tokens"
    assert_idle_and_clean(engine)


# -- min_tokens ----------------------------------------------------------------------------------------------


def test_min_tokens_holds_back_a_forced_eos(engine, reference):
    """EOS biased by +100 would end every request at once; min_tokens=k gives k other tokens, then EOS."""
    ks = [0, 1, 3, 7, 10]
    prompts = [prompt_of(20 + i, 5 + 4 * i) for i in range(len(ks))]
    params = [SamplingParams(max_tokens=10, temperature=0.0, logit_bias={EOS_ID: 100.0}, min_tokens=k,
                             logprobs=2 if k == 3 else None) for k in ks]
    outs = engine.generate(prompts, params, use_tqdm=False)
    for k, prompt, out in zip(ks, prompts, outs):
        if k < 10:
            assert len(out.token_ids) == k + 1 and out.token_ids[-1] == EOS_ID, (k, out.token_ids)
            assert out.finish_reason == "stop", (k, out.finish_reason)
        else:  # min_tokens == max_tokens: never EOS, ends by length
            assert len(out.token_ids) == 10 and out.finish_reason == "length", (k, out.token_ids)
        assert EOS_ID not in out.token_ids[:k]
        assert out.token_ids == reference_greedy(reference, prompt, 10, {EOS_ID: 100.0}, min_tokens=k)
    assert outs[0].token_ids == [EOS_ID]  # min_tokens=0 ends at once
    assert_raw_logprobs(reference, outs[2], 2)
    assert_idle_and_clean(engine)


def test_min_tokens_holds_back_stop_token_ids(engine, reference):
    stop = 77
    ks = [0, 2, 5]
    prompts = [prompt_of(30 + i, 9 + 5 * i) for i in range(len(ks))]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logit_bias={stop: 100.0}, stop_token_ids=[stop, 299],
                             min_tokens=k) for k in ks]
    outs = engine.generate(prompts, params, use_tqdm=False)
    for k, prompt, out in zip(ks, prompts, outs):
        assert out.token_ids[-1] == stop and len(out.token_ids) == k + 1, (k, out.token_ids)
        assert out.finish_reason == "stop" and out.stop_reason == stop, (k, out.finish_reason, out.stop_reason)
        assert not {stop, 299, EOS_ID} & set(out.token_ids[:k])
        assert out.token_ids == reference_greedy(reference, prompt, 12, {stop: 100.0}, min_tokens=k,
                                                 stop_token_ids=(stop, 299))
    assert_idle_and_clean(engine)


def test_min_tokens_same_in_a_mixed_batch(engine, reference):
    """Rows with and without min_tokens, bias and logprobs in one batch, sampled random too: each row's mask
    follows its own count."""
    prompts = [prompt_of(40 + i, 3 + 11 * i) for i in range(6)]
    params = [
        SamplingParams(max_tokens=9, temperature=1.0, seed=i, logit_bias={EOS_ID: 100.0}, min_tokens=i + 2)
        if i % 2 else SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=1)
        for i in range(6)
    ]
    outs = engine.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i % 2:
            assert len(out.token_ids) == i + 3 and out.token_ids[-1] == EOS_ID, (i, out.token_ids)
            assert EOS_ID not in out.token_ids[:-1]
        else:
            assert out.token_ids == reference_greedy(reference, prompt, 9, ignore_eos=True)
    assert_idle_and_clean(engine)


def test_min_tokens_survives_preemption(engine, tiny_dir):
    """Recomputed requests (a cache too small for the batch) keep counting toward min_tokens from their
    outputs so far: the same tokens as the roomy engine, k tokens and then the forced EOS."""
    prompts = [prompt_of(60 + i, 10 + 7 * i) for i in range(6)]
    params = [SamplingParams(max_tokens=25, temperature=0.0, logit_bias={EOS_ID: 100.0}, min_tokens=5 + 3 * i,
                             logprobs=1) for i in range(6)]
    expected = engine.generate(prompts, params, use_tqdm=False)
    with LLM(str(tiny_dir), device="cpu", dtype="float32", overlap=engine.config.overlap, engine_process=False,
             max_num_batched_tokens=16, max_num_seqs=8, block_size=4, num_threads=1, num_kv_blocks=24,
             debug_check_integrity=True) as tight:
        outs = tight.generate(prompts, params, use_tqdm=False)
        assert tight.stats()["preemptions"] > 0, "the cache was meant to be too small"
        assert_idle_and_clean(tight)
    for p, want, got in zip(params, expected, outs):
        assert len(want.token_ids) == p.min_tokens + 1 and want.token_ids[-1] == EOS_ID, want.token_ids
        assert got.token_ids == want.token_ids
        assert got.logprobs.token_ids == got.token_ids
        assert got.logprobs.logprobs == pytest.approx(want.logprobs.logprobs, abs=1e-5)


# -- bad input -----------------------------------------------------------------------------------------------

BAD_PARAMS = [
    ({"logprobs": 21}, ValueError, "logprobs"),
    ({"logprobs": -1}, ValueError, "logprobs"),
    ({"logprobs": 1.5}, TypeError, "logprobs"),
    ({"logprobs": True}, TypeError, "logprobs"),
    ({"logprobs": "3"}, TypeError, "logprobs"),
    ({"prompt_logprobs": -1}, ValueError, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, ValueError, "prompt_logprobs"),
    ({"prompt_logprobs": 2.0}, TypeError, "prompt_logprobs"),
    ({"logit_bias": {5: 100.5}}, ValueError, "logit_bias"),
    ({"logit_bias": {5: -100.5}}, ValueError, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, ValueError, "logit_bias"),
    ({"logit_bias": {5: float("inf")}}, ValueError, "logit_bias"),
    ({"logit_bias": {5: "high"}}, TypeError, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, ValueError, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, ValueError, "logit_bias"),
    ({"logit_bias": {1.5: 1.0}}, TypeError, "logit_bias"),
    ({"logit_bias": [(5, 1.0)]}, TypeError, "logit_bias"),
    ({"min_tokens": 17}, ValueError, "min_tokens"),  # max_tokens defaults to 16
    ({"min_tokens": 5, "max_tokens": 4}, ValueError, "min_tokens"),
    ({"min_tokens": -1}, ValueError, "min_tokens"),
    ({"min_tokens": 2.0}, TypeError, "min_tokens"),
    ({"min_tokens": None}, TypeError, "min_tokens"),
]


@pytest.mark.parametrize("kwargs,error,field", BAD_PARAMS, ids=[repr(k) for k, _, _ in BAD_PARAMS])
def test_invalid_values_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_edge_values_are_accepted():
    params = SamplingParams(logprobs=20, prompt_logprobs=0, logit_bias={"7": -100, 8: 100.0}, min_tokens=16)
    assert params.logit_bias == {7: -100.0, 8: 100.0}
    assert SamplingParams(logprobs=0, prompt_logprobs=20, logit_bias={}).logit_bias is None


OUT_OF_VOCABULARY = [
    ({"logit_bias": {TINY_VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {str(TINY_VOCAB + 5): -1.0}}, "logit_bias"),
    ({"logit_bias": {3: 1.0, 10**6: 1.0}}, "logit_bias"),
    ({"stop_token_ids": [5, TINY_VOCAB]}, "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs,field", OUT_OF_VOCABULARY, ids=[repr(k) for k, _ in OUT_OF_VOCABULARY])
def test_token_ids_outside_the_vocabulary_are_refused_and_the_engine_serves_on(engine, kwargs, field):
    neighbour, neighbour_params = prompt_of(50, 7), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                   logprobs=2)
    expected = engine.generate([neighbour], neighbour_params, use_tqdm=False)[0]
    stream = engine.stream(neighbour, neighbour_params)  # running while the bad request is refused
    with pytest.raises(ValueError, match=field):
        engine.generate([prompt_of(51, 5)], SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)
    streamed = [t for d in stream for t in d.token_ids]
    assert streamed == expected.token_ids
    again = engine.generate([neighbour], neighbour_params, use_tqdm=False)[0]
    assert again.token_ids == expected.token_ids
    assert again.logprobs.logprobs == pytest.approx(expected.logprobs.logprobs, abs=1e-5)
    assert_idle_and_clean(engine)
