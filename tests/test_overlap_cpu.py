"""Overlap mode against synchronous mode on the default model (real torch execution on CPU).

Same requests, same parameters, same seeds: the same tokens, with stop
strings, stop ids, EOS, max_tokens, chunked prefill and preemption in the
mix; aborted requests end with a prefix of what they would have produced.

The claims are about the engine, so they are checked in float32, where a row's
tokens do not depend on its batch; the bfloat16 variant checks the weaker
promise of that dtype (docs/reproducibility.md): the runs part only at near-ties.
"""

from __future__ import annotations

import pytest
from engine_checks import assert_idle_and_clean, wait_all_ended
from reference import assert_bfloat16_runs_agree

from asyncbatch import SamplingParams

pytestmark = pytest.mark.model

TEXTS = ["The weather today", "My favourite food is", "Python is a language that", "In 1969, humans",
         "Rules for a good meeting:", "The ocean is", "Why do cats purr?", "A short poem about rain:"]


def workload(tokenizer):
    prompts, params = [], []
    for i in range(16):
        text = TEXTS[i % len(TEXTS)] + (" Please explain in detail." * (i % 4))
        if i % 4 == 3:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=6 + i, temperature=0.0, stop=[" the", "."]))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=i))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=18, temperature=0.0, stop_token_ids=[13, 28]))
        else:
            params.append(SamplingParams(max_tokens=40, temperature=0.0))  # chat prompt: ends by EOS
    return prompts, params


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 32, "max_num_seqs": 8},  # chunked prefill, joins and leaves
    {"num_kv_blocks": 12, "max_num_batched_tokens": 64, "max_num_seqs": 8},  # preemption
], ids=["chunked", "preempting"])
def test_overlap_equals_sync_on_default_model(make_llm, engine_kwargs):
    runs = {}
    for overlap in (True, False):
        llm = make_llm(device="cpu", dtype="float32", overlap=overlap, debug_check_integrity=True, **engine_kwargs)
        prompts, params = workload(llm.tokenizer)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle_and_clean(llm)
        runs[overlap] = (outs, llm.stats())
    (over, over_stats), (sync, sync_stats) = runs[True], runs[False]
    reasons = set()
    for a, b in zip(over, sync):
        assert a.token_ids == b.token_ids, a.request_id
        assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason)
        reasons.add((a.finish_reason, type(a.stop_reason).__name__))
    assert ("stop", "NoneType") in reasons and ("length", "NoneType") in reasons
    assert ("stop", "str") in reasons or ("stop", "int") in reasons
    assert over_stats["output_tokens"] == sync_stats["output_tokens"] == sum(len(o.token_ids) for o in sync)
    if "num_kv_blocks" in engine_kwargs:
        assert over_stats["preemptions"] > 0 and sync_stats["preemptions"] > 0


@pytest.mark.slow
def test_overlap_equals_sync_on_default_model_bfloat16(make_llm):
    """The preempting case (recomputed prompts are chunked unlike their first pass) in bfloat16, forced so
    every CPU runs it (torch emulates bfloat16 without native support)."""
    runs = {}
    for overlap in (True, False):
        llm = make_llm(device="cpu", dtype="bfloat16", overlap=overlap, debug_check_integrity=True,
                       num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=8)
        prompts, params = workload(llm.tokenizer)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle_and_clean(llm)
        assert llm.stats()["preemptions"] > 0
        runs[overlap] = outs
    over, sync = runs[True], runs[False]
    assert_bfloat16_runs_agree(llm.model_path, "overlap vs sync", prompts, [o.token_ids for o in over],
                               [o.token_ids for o in sync], params)
    for a, b in zip(over, sync):
        if a.token_ids == b.token_ids:
            assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason)


def test_aborted_streams_end_with_a_prefix(make_llm):
    """Three of six streams closed after a few tokens: their requests stop (the engine emits fewer tokens than
    the six would), their tokens are a prefix of an unaborted run's, the other three are whole. The streams are
    read one delta each in turn, so the engine is never far ahead of the reader and the aborts cut running
    requests. A stream kept in a list must be closed (``close()``): leaving a ``for`` loop over it only
    suspends it; leaving a loop over ``llm.stream(...)`` itself closes it, checked last."""
    full_llm = make_llm(device="cpu", dtype="float32")
    prompts, _ = workload(full_llm.tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = [o.token_ids for o in full_llm.generate(prompts[:6], params, use_tqdm=False)]
    llm = make_llm(device="cpu", dtype="float32", overlap=True, debug_check_integrity=True)
    streams = [llm.stream(p, params) for p in prompts[:6]]
    got: list[list[int]] = [[] for _ in streams]
    reading = list(range(len(streams)))
    while reading:
        for i in list(reading):
            delta = next(streams[i], None)
            if delta is None:  # finished
                reading.remove(i)
                continue
            got[i].extend(delta.token_ids)
            if i % 2 == 0 and len(got[i]) >= 3 + i:
                streams[i].close()  # aborts the request
                reading.remove(i)
    for i, tokens in enumerate(got):
        assert tokens == full[i][:len(tokens)]
        if i % 2:
            assert tokens == full[i]
        else:
            assert len(tokens) < len(full[i])
    wait_all_ended(llm)  # the closed ones by their abort, or (were it not taken) by running to their end
    emitted = llm.stats()["output_tokens"]
    assert emitted < 6 * 24, "the closed streams' requests ran to their end"
    for n, _ in enumerate(llm.stream(prompts[0], params)):
        if n == 1:
            break  # the loop held the only reference: the stream is closed and the request aborted
    wait_all_ended(llm)
    assert llm.stats()["output_tokens"] - emitted < 24, "the stream left by its loop ran to its end"
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # a full step after the aborts
    assert_idle_and_clean(llm)
