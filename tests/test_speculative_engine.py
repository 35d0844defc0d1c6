"""Speculative decoding (n-gram prompt lookup) in the engine: the same tokens as without it.

Verification keeps a draft only when the target's own seeded sample at that position equals it
(``speculative.verify``), so speculation may change how many tokens a step emits but never which: greedy
*and* seeded-sampled tokens, penalties included, must equal a non-speculative run's, in overlap and in
synchronous mode, with chunked prefill, preemption and prefix caching, and the block accounting must hold
after every step (``debug_check_integrity``) while the planner reserves KV for drafts one step ahead and
gives back what was not accepted.

Float32 throughout: the claims are about the engine (a verify step computes a row's logits in a batch of
other shape than a plain step does, which in bfloat16 may part at near-ties; docs/reproducibility.md).
"""

from __future__ import annotations

import random

import pytest
from engine_checks import assert_idle_and_clean
from tiny_models import save_tiny_model

from asyncbatch import LLM, SamplingParams
from asyncbatch.config import EngineConfig, SimConfig
from asyncbatch.speculative.config import SpeculativeConfig

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("spec") / "llama", "LlamaForCausalLM",
                           max_position_embeddings=256)


def tiny_workload(n: int = 64) -> tuple[list[list[int]], list[SamplingParams]]:
    """Half input-grounded (a phrase repeated, which the random model tends to continue), half open-ended
    (random ids); greedy, seeded sampling and penalties, stop ids, ``ignore_eos`` and various lengths."""
    rng = random.Random(7)
    prompts, params = [], []
    for i in range(n):
        if i % 2 == 0:
            phrase = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 8))]
            prompt = (phrase * 6)[:rng.randrange(12, 40)]
        else:
            prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))]
        prompts.append(prompt)
        kind = i % 5
        max_tokens = rng.randrange(8, 60)
        if kind == 0:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=i))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[prompt[-1]]))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, repetition_penalty=1.3,
                                         presence_penalty=0.4, frequency_penalty=0.2))
        else:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, frequency_penalty=0.5))
    return prompts, params


def run(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    assert_idle_and_clean(llm)
    return [(o.token_ids, o.finish_reason, o.stop_reason) for o in outs]


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 64, "max_num_seqs": 16},  # chunked prefill, joins and leaves, prefix caching
    {"num_kv_blocks": 40, "max_num_batched_tokens": 128, "max_num_seqs": 16},  # preemption
], ids=["chunked", "preempting"])
def test_speculative_tokens_equal_plain_tokens_on_a_tiny_model(make_llm, tiny_model, engine_kwargs):
    prompts, params = tiny_workload()
    common = dict(device="cpu", dtype="float32", engine_process=False, debug_check_integrity=True, **engine_kwargs)
    reference = run(make_llm(tiny_model, **common), prompts, params)
    for overlap in (True, False):
        llm = make_llm(tiny_model, overlap=overlap, speculative_config=SPEC, **common)
        got = run(llm, prompts, params)
        for i, (a, b) in enumerate(zip(got, reference)):
            assert a == b, (overlap, i, params[i])
        stats = llm.stats()
        # Drafts were verified, some accepted (the mean acceptance length is above one token a step) and some
        # rejected, so both the keep and the give-back paths ran.
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
        assert stats["spec_decode_mean_acceptance_length"] > 1.0
        assert stats["output_tokens"] == sum(len(t) for t, _, _ in reference)
        if "num_kv_blocks" in engine_kwargs:
            assert stats["preemptions"] > 0
    assert {r for _, r, _ in reference} == {"stop", "length"}


def test_a_request_that_needs_sampler_extras_turns_verification_off_while_it_runs(make_llm, tiny_model):
    """Logprobs, logit_bias, min_tokens and grammars need one token a row: while such a request is live no step
    verifies drafts; the others' tokens are still the plain ones, and verification resumes once it ends."""
    prompts, params = tiny_workload(8)
    # Submitted first and outliving the others (max_tokens <= 60 each), so it is live in every step they run in.
    extra = SamplingParams(max_tokens=80, temperature=0.0, logprobs=2, ignore_eos=True)
    prompts, params = [prompts[0], *prompts], [extra, *params]
    common = {"device": "cpu", "dtype": "float32", "engine_process": False, "debug_check_integrity": True}
    reference = make_llm(tiny_model, **common).generate(prompts, params, use_tqdm=False)
    llm = make_llm(tiny_model, speculative_config=SPEC, **common)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    assert got[0].logprobs.logprobs == pytest.approx(reference[0].logprobs.logprobs, abs=1e-5)
    assert llm.stats()["spec_decode_num_draft_tokens"] == 0
    llm.generate([prompts[1]], params[1], use_tqdm=False)
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_large_batches_verify_no_drafts(make_llm, tiny_model):
    """``disable_by_batch_size``: a step with more decode rows than that plans no drafts."""
    prompts, _params = tiny_workload(12)
    llm = make_llm(tiny_model, device="cpu", dtype="float32", engine_process=False,
                   speculative_config={**SPEC, "disable_by_batch_size": 4})
    llm.generate(list(prompts), [SamplingParams(max_tokens=3, temperature=0.0)] * 12,
                 use_tqdm=False)
    assert all(r.spec_draft_tokens == 0 for r in llm.timeline.records if r.num_decode > 4)


@pytest.mark.model
def test_speculative_tokens_equal_plain_tokens_on_the_default_model(make_llm):
    """Input-grounded chat (rewrite a given text) and open-ended prompts on SmolLM2, greedy and seeded."""
    text = ("The river flows through the old town, past the market square and the stone bridge. Every morning "
            "the bakers open their shops, and the smell of fresh bread fills the narrow streets.")
    common = {"device": "cpu", "dtype": "float32", "max_num_seqs": 8, "debug_check_integrity": True, "engine_process": False}
    runs = []
    for spec in (None, SPEC, SPEC):
        llm = make_llm(speculative_config=spec, overlap=len(runs) != 2, **common)
        tok = llm.tokenizer
        chat = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text word for word:\n\n{text}"}],
                                       tokenize=False, add_generation_prompt=True)
        prompts = [tok.encode(chat, add_special_tokens=False),
                   tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return", add_special_tokens=False),
                   tok.encode("Three facts about the moon:", add_special_tokens=False),
                   tok.encode("Once upon a time", add_special_tokens=False)]
        params = [SamplingParams(max_tokens=40, temperature=0.0), SamplingParams(max_tokens=16, temperature=0.0),
                  SamplingParams(max_tokens=16, temperature=0.8, seed=3), SamplingParams(max_tokens=16, temperature=0.0,
                                                                                        repetition_penalty=1.2)]
        runs.append((run(llm, prompts, params), llm.stats()))
    (plain, _), (overlap, overlap_stats), (sync, sync_stats) = runs
    assert overlap == plain and sync == plain
    # The rewrite is mostly copied: several tokens a step, in both modes.
    assert min(overlap_stats["spec_decode_mean_acceptance_length"], sync_stats["spec_decode_mean_acceptance_length"]) > 1.5


@pytest.mark.parametrize(("field", "value"), [
    ("num_speculative_tokens", 0), ("num_speculative_tokens", 9), ("prompt_lookup_min", 0),
    ("prompt_lookup_max", 1), ("method", "medusa"), ("method", "draft_model"), ("disable_by_batch_size", 0),
    ("min_acceptance", 1.5),
])
def test_bad_speculative_config_is_a_value_error_naming_the_field(field, value):
    settings = {"prompt_lookup_min": 2, field: value}
    with pytest.raises(ValueError, match=field if field != "method" else "method"):
        SpeculativeConfig(**settings)


def test_speculation_is_refused_where_it_does_not_run():
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(device="cuda", speculative_config=SPEC)
    with pytest.raises(ValueError, match="compile_decode"):
        EngineConfig(device="cpu", compile_decode=True, speculative_config=SPEC)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(device="cpu", block_size=4, speculative_config=SPEC)
    with pytest.raises(ValueError, match="unknown field"):
        EngineConfig(device="cpu", speculative_config={"num_spec_tokens": 3})


@pytest.mark.parametrize("num_kv_blocks", [400, 40], ids=["roomy", "preempting"])
def test_sim_verify_steps_give_the_plain_tokens_under_overlap_and_preemption(make_llm, num_kv_blocks):
    """The simulated device models a verify step (each draft accepted with ``SimConfig.spec_acceptance``): 200
    requests at 64 running, with and without speculation, overlap and sync, integrity checked every step."""
    sim = SimConfig(step_fixed_ms=0.2, per_token_us=0, per_context_token_ns=0, output_len_min=8, output_len_max=120)
    prompts = [[5 + (i % 50)] * (10 + i % 30) for i in range(200)]
    params = [SamplingParams(max_tokens=100, temperature=0.0, seed=i, min_tokens=20 if i == 7 else 0)
              for i in range(200)]
    runs = {}
    for name, spec, overlap in [("plain", None, True), ("overlap", SPEC, True), ("sync", SPEC, False)]:
        llm = make_llm(device="sim", engine_process=False, overlap=overlap, debug_check_integrity=True,
                       num_kv_blocks=num_kv_blocks, max_num_seqs=64, sim=sim, speculative_config=spec)
        runs[name] = (run(llm, prompts, params), llm.stats())
    plain, plain_stats = runs["plain"]
    for name in ("overlap", "sync"):
        got, stats = runs[name]
        assert got == plain, name
        assert stats["spec_decode_mean_acceptance_length"] > 2.0  # 0.7 per draft: 2.8 expected of 4 drafts
        assert stats["steps"] < plain_stats["steps"]
        if num_kv_blocks == 40:
            assert stats["preemptions"] > 0


def test_speculative_counters_reach_the_metrics_endpoint():
    """``/metrics`` carries vLLM's three counters, cumulative over every step ever recorded."""
    from asyncbatch.profiling.timeline import StepRecord, Timeline
    from asyncbatch.serve.metrics import ServeMetrics

    timeline = Timeline(max_records=8)
    for step in range(20):
        record = StepRecord(step + 1)
        record.spec_drafts, record.spec_draft_tokens, record.spec_accepted_tokens = 2, 8, 3
        timeline.add(record)
    text = ServeMetrics("m", timeline, lambda: (0, 0), lambda: None).render().decode()
    assert 'asyncbatch:spec_decode_num_draft_tokens_total{model_name="m"} 160.0' in text
    assert 'asyncbatch:spec_decode_num_accepted_tokens_total{model_name="m"} 60.0' in text
    assert 'asyncbatch:spec_decode_num_drafts_total{model_name="m"} 40.0' in text
