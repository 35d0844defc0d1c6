"""Speculative decoding (n-gram prompt lookup, and a draft model) in the engine: the same tokens as without it.

Verification keeps a draft only when the target's own seeded sample at that position equals it
(``speculative.verify``), so speculation may change how many tokens a step emits but never which: greedy
*and* seeded-sampled tokens, penalties included, must equal a non-speculative run's, in overlap and in
synchronous mode, with chunked prefill, preemption and prefix caching, and the block accounting must hold
after every step (``debug_check_integrity``) while the planner reserves KV for drafts one step ahead and
gives back what was not accepted. A draft model runs its own KV cache in the target's blocks, so the same
claims cover it with drafts that are nearly all right (the target drafting for itself) and nearly all wrong
(a one-layer cut of the target).

Float32 throughout: the claims are about the engine (a verify step computes a row's logits in a batch of
other shape than a plain step does, which in bfloat16 may part at near-ties; docs/reproducibility.md).
"""

from __future__ import annotations

import json
import random
import re
import shutil

import numpy as np
import pytest
from engine_checks import assert_idle_and_clean
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_model

from asyncbatch import LLM, SamplingParams, StructuredOutputsParams
from asyncbatch.config import EngineConfig, SimConfig
from asyncbatch.speculative.config import SpeculativeConfig

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("spec") / "llama", "LlamaForCausalLM",
                           max_position_embeddings=256)


@pytest.fixture(scope="module")
def shallow_draft(tiny_model, tmp_path_factory):
    """The target's first layer alone (same embeddings, norm and LM head): another model with the target's
    vocabulary and another KV shape (one layer), whose greedy tokens agree with the target's now and then."""
    folder = tmp_path_factory.mktemp("spec") / "shallow"
    shutil.copytree(tiny_model, folder)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers.1." not in k}, folder / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return folder


def proposer(name: str, tiny_model, shallow_draft) -> dict:
    """``SPEC`` with the named proposer: the n-gram lookup, or a draft model (the target itself, or its cut)."""
    if name == "ngram":
        return SPEC
    draft = {"draft_self": tiny_model, "draft_shallow": shallow_draft}[name]
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4, "disable_by_batch_size": None}


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


ENGINES = {
    "chunked": {"max_num_batched_tokens": 64, "max_num_seqs": 16},  # chunked prefill, joins and leaves, prefix caching
    "preempting": {"num_kv_blocks": 40, "max_num_batched_tokens": 128, "max_num_seqs": 16},  # preemption
}
_plain_runs: dict[tuple, list[tuple]] = {}


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_shallow"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_speculative_tokens_equal_plain_tokens_on_a_tiny_model(make_llm, tiny_model, shallow_draft, engine, method):
    engine_kwargs = ENGINES[engine]
    n = 64 if method == "ngram" else 40  # a draft model's steps cost more on the CPU: a shorter workload
    prompts, params = tiny_workload(n)
    common = dict(device="cpu", dtype="float32", engine_process=False, debug_check_integrity=True, **engine_kwargs)
    key = (str(tiny_model), engine, n)
    if key not in _plain_runs:  # the plain reference, once per engine and workload
        _plain_runs[key] = run(make_llm(tiny_model, **common), prompts, params)
    reference = _plain_runs[key]
    for overlap in (True, False):
        llm = make_llm(tiny_model, overlap=overlap, speculative_config=proposer(method, tiny_model, shallow_draft),
                       **common)
        got = run(llm, prompts, params)
        for i, (a, b) in enumerate(zip(got, reference)):
            assert a == b, (overlap, i, params[i])
        stats = llm.stats()
        # Drafts were verified, some accepted (the mean acceptance length is above one token a step) and some
        # rejected, so both the keep and the give-back paths ran.
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
        assert stats["spec_decode_mean_acceptance_length"] > 1.0
        if method == "draft_self":  # every greedy row's drafts are right (sampled and penalised rows' are not)
            assert stats["spec_decode_mean_acceptance_length"] > 2.0
        assert stats["output_tokens"] == sum(len(t) for t, _, _ in reference)
        if "num_kv_blocks" in engine_kwargs:
            assert stats["preemptions"] > 0
    assert {r for _, r, _ in reference} == {"stop", "length"}


def _mixed_workload(seed: int, max_model_len: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Random requests that mix what a step must handle at once: prompts from one token to past the token
    budget and up to the context's end, stop strings and ids, ``ignore_eos``, logprobs, ``min_tokens``,
    penalties and grammars (choices, regexes, JSON), greedy and seeded; ``max_tokens`` fitted to the context."""
    rng = random.Random(seed)
    grammars = [{"choice": ["ab", "abc", "b"]}, {"regex": "(ab|c)+d?"}, {"json_object": True}, {"regex": "[a-z]{2,9}"}]
    prompts, params = [], []
    for i in range(24):
        phrase = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 5))]
        prompt = (phrase * 80)[:rng.choice([1, 2, 5, 17, 33, 60, max_model_len - 2])]
        kw: dict = {"max_tokens": min(rng.choice([1, 2, 7, 30, 60]), max_model_len - len(prompt)),
                    "temperature": rng.choice([0.0, 0.0, 1.0]), "seed": i}
        if rng.random() < 0.3:
            kw["stop"] = [rng.choice(["a", "ab", "e"])]
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(3, 250)]
        kw["ignore_eos"] = rng.random() < 0.2
        kw["logprobs"] = 1 if rng.random() < 0.2 else None
        kw["min_tokens"] = min(kw["max_tokens"], 3) if rng.random() < 0.2 else 0
        kw["presence_penalty"] = 0.5 if rng.random() < 0.2 else 0.0
        if rng.random() < 0.3:
            kw["structured_outputs"] = StructuredOutputsParams(**rng.choice(grammars))
            kw.pop("stop", None)
        prompts.append(prompt)
        params.append(SamplingParams(**kw))
    return prompts, params


@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_random_workloads_give_the_plain_tokens(make_llm, tiny_model, seed):
    """Random mixes of every feature a step must handle at once (``_mixed_workload``) in a tight engine: a budget
    smaller than the longest prompts (steps that sample nothing), prompts up to the context's end, a KV cache
    that preempts. N-gram and a draft model, overlap and sync: every request's tokens, finish and text equal
    plain decoding's, and the block accounting holds after every step."""
    pytest.importorskip("xgrammar", reason="structured outputs need the structured extra")
    engine = {"device": "cpu", "dtype": "float32", "engine_process": False, "debug_check_integrity": True,
              "max_model_len": 80, "max_num_batched_tokens": 32, "max_num_seqs": 8, "num_kv_blocks": 16}
    prompts, params = _mixed_workload(seed, engine["max_model_len"])

    def outcome(llm) -> list[tuple]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle_and_clean(llm)
        return [(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in outs]

    reference = outcome(make_llm(tiny_model, **engine))
    for method in ("ngram", "draft_self"):
        for overlap in (True, False):
            llm = make_llm(tiny_model, overlap=overlap, speculative_config=proposer(method, tiny_model, None),
                           **engine)
            assert outcome(llm) == reference, (method, overlap)
            assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
            assert llm.stats()["preemptions"] > 0


def test_rows_that_reach_max_model_len_in_a_verify_step(make_llm, tiny_model):
    """Requests that run to ``max_model_len`` while other rows draft: a verify step spans every row to the widest
    one's drafts, so a row at the end of the model's length computes positions past it (dropped, and clamped to
    the rotary table: this once killed the engine). Same tokens as plain, both proposers."""
    prompts, params = tiny_workload(16)
    params = [SamplingParams(max_tokens=48 - len(prompt), temperature=p.temperature, seed=p.seed, ignore_eos=True)
              for prompt, p in zip(prompts, params)]
    common = {"device": "cpu", "dtype": "float32", "engine_process": False, "debug_check_integrity": True,
              "max_model_len": 48, "max_num_seqs": 8}
    reference = run(make_llm(tiny_model, **common), prompts, params)
    for method in ("ngram", "draft_self"):
        spec = {**proposer(method, tiny_model, None), "num_speculative_tokens": 7}
        llm = make_llm(tiny_model, speculative_config=spec, **common)
        assert run(llm, prompts, params) == reference, method
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_draft_model_drafting_for_itself_is_always_right_for_greedy_rows(make_llm, tiny_model):
    """Greedy rows without penalties: the target's own greedy drafts are its tokens, so every draft is accepted.
    Any draft KV out of step with the target's (a chunk not followed, a reused prefix block without the draft's
    KV, a recomputed request) would show here as a rejection."""
    prompts, params = tiny_workload(16)
    prompts = prompts + prompts[:8]  # the repeats reuse the first ones' cached prefix blocks
    greedy = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True) for p in params]
    greedy = greedy + greedy[:8]
    llm = make_llm(tiny_model, device="cpu", dtype="float32", engine_process=False, debug_check_integrity=True,
                   num_kv_blocks=20, max_num_batched_tokens=48, max_num_seqs=8,
                   speculative_config=proposer("draft_self", tiny_model, None))
    run(llm, prompts, greedy)
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def _extras_workload(grounded: list[int], stop_id: int, min_tokens: int) -> list[SamplingParams]:
    """Requests that need more of the sampler than a token a step, for a grounded prompt (the kind that drafts):
    ``min_tokens`` keeps ``stop_id`` (a token the prompt's greedy continuation holds before it) banned."""
    return [
        SamplingParams(max_tokens=80, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=70, temperature=0.8, seed=11, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=70, temperature=0.0, logit_bias={grounded[1]: 4.0, 7: -100.0}, ignore_eos=True),
        SamplingParams(max_tokens=70, temperature=0.0, min_tokens=min_tokens, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=70, temperature=1.0, seed=3,
                       structured_outputs=StructuredOutputsParams(regex=r"(ab|ba){5,30}")),
    ]


@pytest.mark.parametrize("overlap, engine_process", [(True, False), (False, False), (True, True)],
                         ids=["overlap", "sync", "core-process"])
def test_rows_with_sampler_extras_beside_rows_that_verify_drafts(make_llm, tiny_model, overlap, engine_process):
    """Rows that need more of the sampler verify drafts beside plain rows: a grammar row under a mask per position
    (the host's walk along its drafts), logprob rows scored at every position, logit_bias and min_tokens rows
    biased at every position by its output index. Every
    request's tokens, logprobs and prompt logprobs equal a run without speculation: overlap and sync in process,
    and through the engine-core process (logprob columns of rows that emitted several tokens, beside rows of
    one, cross the wire)."""
    pytest.importorskip("xgrammar", reason="structured outputs need the structured extra")
    prompts, params = tiny_workload(16)
    grounded = prompts[0]
    common = {"device": "cpu", "dtype": "float32", "engine_process": engine_process, "debug_check_integrity": True,
              "overlap": overlap}
    plain = make_llm(tiny_model, **common)
    greedy = plain.generate([grounded], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    stop_id = max(set(greedy[5:]), key=greedy[5:].count)  # a token it repeats; min_tokens bans it for a while
    extras = _extras_workload(grounded, stop_id, greedy.index(stop_id, 5) + 3)
    # Eight token rows: the extras requests first and long, the plain ones through the three rows left. One
    # asking for prompt logprobs waits behind six plain ones, so they are scored in a step whose decode rows
    # verify drafts.
    late = len(extras) + 6
    prompts = [*[grounded] * len(extras), *prompts[:6], grounded[::-1], *prompts[6:]]
    params = [*extras, *params[:6], SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=2, ignore_eos=True),
              *params[6:]]
    common["max_num_seqs"] = 8
    reference = plain.generate(prompts, params, use_tqdm=False)
    llm = make_llm(tiny_model, speculative_config=SPEC, **common)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_idle_and_clean(llm)
    assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in reference]
    for i in (0, 1):
        assert len(got[i].logprobs.logprobs) == len(got[i].token_ids)
        assert got[i].logprobs.logprobs == pytest.approx(reference[i].logprobs.logprobs, abs=1e-5)
        assert got[i].logprobs.top_token_ids == reference[i].logprobs.top_token_ids
    assert 7 not in got[2].token_ids
    assert got[3].token_ids != greedy[:len(got[3].token_ids)] and stop_id not in got[3].token_ids[:extras[3].min_tokens]
    assert got[4].finish_reason == "stop" and re.fullmatch(r"(ab|ba){5,30}", got[4].text)
    assert len(got[late].prompt_logprobs.logprobs) == len(grounded) - 1
    assert got[late].prompt_logprobs.logprobs == pytest.approx(reference[late].prompt_logprobs.logprobs, abs=1e-5)
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    # The logprob, bias and min_tokens requests alone: their drafts are verified and accepted (min_tokens' ban
    # holding at each position by its output index), a logprob for every token emitted.
    alone = llm.generate(prompts[:4], params[:4], use_tqdm=False)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_accepted_tokens"]
    assert [o.token_ids for o in alone] == [o.token_ids for o in got[:4]]
    for i in (0, 1):
        assert alone[i].logprobs.logprobs == pytest.approx(reference[i].logprobs.logprobs, abs=1e-5)
        assert np.allclose(alone[i].logprobs.top_logprobs, reference[i].logprobs.top_logprobs, atol=1e-5)
        assert alone[i].logprobs.top_token_ids == reference[i].logprobs.top_token_ids
        assert alone[i].logprobs.ranks == reference[i].logprobs.ranks


def _grammar_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Every case of the structured-output catalogue, greedy and seeded, on prompts that repeat a phrase (the kind
    that drafts), and a regex whose output repeats itself (the n-gram proposer's best case)."""
    from harness.structured_cases import CASES

    prompts, params = [], []
    for i, case in enumerate(CASES):
        prompts.append([5 + i, 6, 7, 8] * 3)
        params.append(SamplingParams(max_tokens=60, temperature=0.0 if i % 2 else 0.9, seed=i,
                                     structured_outputs=case.params))
    prompts.append([5, 6, 7])
    params.append(SamplingParams(max_tokens=70, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(regex=r"(ab|ba){5,30}")))
    return prompts, params


@pytest.fixture(scope="module")
def own_continuations(tiny_model) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests whose only choice is the model's own greedy continuation of their prompt, where that is
    one printable ASCII character a token: the grammar allows what the model prefers anyway, so a draft model
    drafting for itself has its drafts accepted under the mask of each position (a random model's grammar rows
    otherwise accept few: its unconstrained argmax is rarely allowed). Found once for the module (503 prompts):
    in float32 a row's greedy tokens do not depend on the engine's mode or batch."""
    candidates = [[i] * 4 for i in range(3, 259)] + [[i, i + 1, i + 2] * 2 for i in range(3, 250)]
    with LLM(str(tiny_model), device="cpu", dtype="float32", engine_process=False) as llm:
        outs = llm.generate(candidates, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    own = [(p, o.text) for p, o in zip(candidates, outs)
           if o.text.isascii() and o.text.isprintable() and len(o.text) == len(o.token_ids)][:3]
    assert own, "no prompt of the tiny model continues in printable ASCII"
    return [p for p, _ in own], [SamplingParams(max_tokens=40, temperature=0.0,
                                                structured_outputs=StructuredOutputsParams(choice=[text]))
                                 for _, text in own]


@pytest.mark.parametrize("overlap, engine_process, engine", [(True, False, None), (False, False, None),
                                                              (True, True, None), (True, False, "preempting"),
                                                              (True, False, "chunked")],
                         ids=["overlap", "sync", "core-process", "preempting", "chunked"])
@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_grammar_rows_verify_drafts_under_a_mask_per_position(make_llm, tiny_model, own_continuations, method, overlap,
                                                              engine_process, engine):
    """The host fills a grammar row's mask at each position along its drafts, so grammar rows verify drafts like
    any other row: n-gram drafts reach the host with the step that made them, a draft model's mid-step, from
    the step that checks them (``GrammarMask.device_drafts``: in sync mode and after idle the fill waits for
    them after the launch). With only grammar requests running, drafts are accepted; every token equals a run
    without speculation (greedy and seeded), and every output its grammar finished satisfies it, also with
    preemption (a grammar row recomputed, its matcher kept) and chunked prefill."""
    pytest.importorskip("xgrammar", reason="structured outputs need the structured extra")
    from harness.structured_cases import CASES

    prompts, params = _grammar_workload()
    common = {"device": "cpu", "dtype": "float32", "engine_process": engine_process, "debug_check_integrity": True,
              "overlap": overlap, **ENGINES.get(engine, {})}
    plain = make_llm(tiny_model, **common)
    own_prompts, own_params = own_continuations
    prompts, params = prompts + own_prompts, params + own_params
    reference = run(plain, prompts, params)
    llm = make_llm(tiny_model, speculative_config=proposer(method, tiny_model, None), **common)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_idle_and_clean(llm)
    assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in outs] == reference
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 20, stats
    assert (stats["preemptions"] > 0) == (engine == "preempting")
    # Only a draft model's drafts are waited for (in the planner's fill); n-gram drafts are on the host already.
    assert (stats["drafts_wait_ms_per_step"] > 0) == (method == "draft_self"), stats
    stopped = [i for i, o in enumerate(outs[:len(CASES)]) if o.finish_reason == "stop"]
    assert len(stopped) >= len(CASES) // 2
    for i in stopped:
        CASES[i].check(outs[i].text)
    regex = len(prompts) - len(own_prompts) - 1
    assert outs[regex].finish_reason == "stop" and re.fullmatch(r"(ab|ba){5,30}", outs[regex].text)
    for out, own in zip(outs[regex + 1:], own_params):
        assert out.finish_reason == "stop" and out.text == own.structured_outputs.choice[0]


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_prompt_longer_than_the_token_budget_prefills_in_steps_that_sample_nothing(make_llm, tiny_model, method,
                                                                                     overlap):
    """A prompt past ``max_num_batched_tokens`` prefills in chunks over several steps, the first of which sample
    nothing and, with nothing else running, decode nothing either: a speculative engine applies such a step (it
    failed the whole engine before: ``apply_verified`` could not shape an empty step's tokens). Tokens and
    prompt logprobs equal plain decoding's; the rows verify drafts once they decode."""
    prompts = [[5, 6, 7, 8] * 12, [9, 10, 11] * 15]  # 48 and 45 tokens against a budget of 16
    params = [SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=1),
              SamplingParams(max_tokens=24, temperature=1.0, seed=5)]
    common = {"device": "cpu", "dtype": "float32", "engine_process": False, "overlap": overlap,
              "max_num_batched_tokens": 16, "max_num_seqs": 4, "debug_check_integrity": True}
    for one_at_a_time in (True, False):  # alone (steps with no row at all), then beside each other
        batches = [[0], [1]] if one_at_a_time else [[0, 1]]
        plain, spec = make_llm(tiny_model, **common), make_llm(tiny_model, speculative_config=proposer(
            method, tiny_model, None), **common)
        for batch in batches:
            expected = plain.generate([prompts[i] for i in batch], [params[i] for i in batch], use_tqdm=False)
            got = spec.generate([prompts[i] for i in batch], [params[i] for i in batch], use_tqdm=False)
            assert [o.token_ids for o in got] == [o.token_ids for o in expected]
            for g, e in zip(got, expected):
                if e.prompt_logprobs is not None:
                    assert g.prompt_logprobs.logprobs == pytest.approx(e.prompt_logprobs.logprobs, abs=1e-5)
        assert_idle_and_clean(spec)
        assert spec.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_large_batches_verify_no_drafts(make_llm, tiny_model, method):
    """``disable_by_batch_size``: a step with more decode rows than that plans no drafts (a draft model's too);
    smaller steps do verify drafts."""
    prompts, _params = tiny_workload(12)
    llm = make_llm(tiny_model, device="cpu", dtype="float32", engine_process=False,
                   speculative_config={**proposer(method, tiny_model, None), "disable_by_batch_size": 4})
    params = [SamplingParams(max_tokens=3 + 5 * (i % 4), temperature=0.0, ignore_eos=True) for i in range(12)]
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    assert all(r.spec_draft_tokens == 0 for r in llm.timeline.records if r.num_decode > 4)
    if method == "draft_self":  # the batch's tail, at 4 rows or fewer, drafts again; still the plain tokens
        assert sum(r.spec_draft_tokens for r in llm.timeline.records if r.num_decode <= 4) > 0
        plain = make_llm(tiny_model, device="cpu", dtype="float32", engine_process=False)
        expected = plain.generate(list(prompts), params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


def test_waiting_prompts_take_the_budget_before_drafts(make_llm):
    """``prefill_first`` (the default): while requests wait for a token row, a verify step's drafts take only
    what their prompts leave of the token budget, so a burst is admitted step for step as fast as without
    speculation; ``prefill_first=False`` (vLLM's order) lets drafts take the budget first and the burst trickles
    in. The tokens are the plain ones either way (the sim's chain)."""
    prompts = [[300 + i] * 8 for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sim = SimConfig(step_fixed_ms=0.2, per_token_us=0.0, per_context_token_ns=0.0)
    common = {"device": "sim", "sim": sim, "engine_process": False, "max_num_seqs": 16, "max_num_batched_tokens": 64,
              "debug_check_integrity": True}
    runs = {}
    for name, spec in (("plain", None), ("prefill_first", {"disable_by_batch_size": None}),
                       ("drafts_first", {"disable_by_batch_size": None, "prefill_first": False})):
        llm = make_llm(speculative_config=spec, **common)
        outs = llm.generate(prompts, params, use_tqdm=False)
        records = sorted(llm.timeline.records, key=lambda r: r.step_id)
        runs[name] = ([o.token_ids for o in outs], [r for r in records if r.num_admitted])
    tokens, admitting = runs["plain"]
    assert [r.num_admitted for r in admitting] == [8, 7, 1]  # 64 tokens a step: 8 prompts, then 56 beside 8 rows
    assert [r.num_admitted for r in runs["prefill_first"][1]] == [8, 7, 1]
    # The step that admits 7 beside 8 decode rows has no budget left for drafts; the last one has (2 a row).
    assert [r.spec_draft_tokens for r in runs["prefill_first"][1]][:2] == [0, 0]
    first_drafts = runs["drafts_first"][1]
    assert len(first_drafts) > 3 and first_drafts[1].spec_draft_tokens > 0  # drafts took the budget first
    assert sum(r.num_admitted for r in first_drafts) == 16
    assert runs["prefill_first"][0] == tokens and runs["drafts_first"][0] == tokens


@pytest.mark.model
def test_speculative_tokens_equal_plain_tokens_on_the_default_model(make_llm):
    """Input-grounded chat (rewrite a given text) and open-ended prompts on SmolLM2, greedy and seeded; n-gram in
    overlap and sync mode, and SmolLM2 drafting for itself (``method="draft_model"``, overlap)."""
    text = ("The river flows through the old town, past the market square and the stone bridge. Every morning "
            "the bakers open their shops, and the smell of fresh bread fills the narrow streets.")
    common = {"device": "cpu", "dtype": "float32", "max_num_seqs": 8, "debug_check_integrity": True, "engine_process": False}
    runs = []
    draft = {"model": "smollm2-135m", "num_speculative_tokens": 3}
    for spec in (None, SPEC, SPEC, draft):
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
    (plain, _), (overlap, overlap_stats), (sync, sync_stats), (drafted, draft_stats) = runs
    assert overlap == plain and sync == plain and drafted == plain
    assert draft_stats["spec_decode_mean_acceptance_length"] > 2.0  # its own greedy tokens: the greedy rows' all right
    # The rewrite is mostly copied: several tokens a step, in both modes.
    assert min(overlap_stats["spec_decode_mean_acceptance_length"], sync_stats["spec_decode_mean_acceptance_length"]) > 1.5


@pytest.mark.parametrize(("field", "value"), [
    ("num_speculative_tokens", 0), ("num_speculative_tokens", 9), ("prompt_lookup_min", 0),
    ("prompt_lookup_max", 1), ("method", "medusa"), ("disable_by_batch_size", 0), ("min_acceptance", 1.5),
    ("prefill_first", "yes"),
])
def test_bad_speculative_config_is_a_value_error_naming_the_field(field, value):
    settings = {"prompt_lookup_min": 2, field: value}
    with pytest.raises(ValueError, match=field if field != "method" else "method"):
        SpeculativeConfig(**settings)


def test_the_kv_budget_counts_the_draft_models_cache(make_llm, tiny_model, shallow_draft):
    """Each block holds a token's KV in the target and in the draft: under one memory budget a draft as large as
    the target halves the blocks, a one-layer draft of a two-layer target leaves two thirds; the caches of both
    stay within the budget."""
    common = {"device": "cpu", "dtype": "float32", "engine_process": False, "kv_cache_memory_gib": 1 / 1024}
    blocks, info = {}, {}
    for name in ("ngram", "draft_self", "draft_shallow"):
        llm = make_llm(tiny_model, speculative_config=proposer(name, tiny_model, shallow_draft), **common)
        blocks[name], info[name] = llm.num_usable_blocks, llm.executor_info
        assert info[name]["kv_cache_mib"] <= 1.001  # 1 MiB, and each tensor's storage rounded up (~64 bytes)
    assert blocks["draft_self"] + 1 == (blocks["ngram"] + 1) // 2  # usable blocks: all but the dummy block
    assert blocks["draft_shallow"] + 1 == (blocks["ngram"] + 1) * 2 // 3


def test_the_draft_model_field_is_required_by_draft_model_and_refused_with_ngram():
    with pytest.raises(ValueError, match=r"speculative_config\.model is required"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match=r"speculative_config\.model must not be given with method='ngram'"):
        SpeculativeConfig(method="ngram", model="smollm2-135m")
    with pytest.raises(ValueError, match=r"speculative_config\.model must be a non-empty"):
        SpeculativeConfig(method="draft_model", model="")
    # vLLM's inference: a model means a draft model, the name "ngram" the n-gram proposer; neither, n-gram.
    assert SpeculativeConfig(model="smollm2-135m").method == "draft_model"
    assert (SpeculativeConfig(model="[ngram]").method, SpeculativeConfig(model="[ngram]").model) == ("ngram", None)
    assert SpeculativeConfig().method == "ngram"


def _copy_with(tiny_model, folder, swap_tokens: bool = False, **config_changes):
    """The target's folder with ``config_changes`` in its config, or two tokens' ids swapped in its tokenizer."""
    shutil.copytree(tiny_model, folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    if swap_tokens:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        a, b = list(vocab)[10:12]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


@pytest.mark.parametrize("change", ["vocab_size", "tokenizer", "missing", "context"])
def test_a_draft_model_that_cannot_draft_for_the_target_is_refused_at_engine_start(tiny_model, tmp_path, change):
    """Another vocabulary (its size, or the token-to-id map where both tokenizers are there), no model at all, or
    a context shorter than the engine's ``max_model_len``: a ValueError naming ``speculative_config.model`` when
    the engine starts, before any weights load."""
    draft = {"vocab_size": lambda: _copy_with(tiny_model, tmp_path / "d", vocab_size=320),
             "tokenizer": lambda: _copy_with(tiny_model, tmp_path / "d", swap_tokens=True),
             "missing": lambda: tmp_path / "nowhere",
             "context": lambda: _copy_with(tiny_model, tmp_path / "d", max_position_embeddings=64)}[change]()
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        LLM(tiny_model, device="cpu", dtype="float32", engine_process=False,
            speculative_config={"model": str(draft)})


def test_speculation_is_refused_where_it_does_not_run():
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(device="cuda", speculative_config=SPEC)
    EngineConfig(device="cpu", dtype="float32", compile_decode=True, speculative_config=SPEC)  # verify steps compile
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(device="cpu", block_size=4, speculative_config=SPEC)
    with pytest.raises(ValueError, match="unknown field"):
        EngineConfig(device="cpu", speculative_config={"num_spec_tokens": 3})


@pytest.mark.parametrize("num_kv_blocks", [400, 40], ids=["roomy", "preempting"])
def test_sim_verify_steps_give_the_plain_tokens_under_overlap_and_preemption(make_llm, num_kv_blocks):
    """The simulated device models a verify step (each draft accepted with ``SimConfig.spec_acceptance``): 200
    requests at 64 running, with and without speculation, overlap and sync, integrity checked every step. A
    draft model is modelled the same way, and its forwards cost device time (``SimConfig.draft_seconds``)."""
    sim = SimConfig(step_fixed_ms=0.2, per_token_us=0, per_context_token_ns=0, output_len_min=8, output_len_max=120)
    prompts = [[5 + (i % 50)] * (10 + i % 30) for i in range(200)]
    params = [SamplingParams(max_tokens=100, temperature=0.0, seed=i, min_tokens=20 if i == 7 else 0)
              for i in range(200)]
    runs = {}
    draft = {"model": "smollm2-135m", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    for name, spec, overlap in [("plain", None, True), ("overlap", SPEC, True), ("sync", SPEC, False),
                                ("draft", draft, True)]:
        llm = make_llm(device="sim", engine_process=False, overlap=overlap, debug_check_integrity=True,
                       num_kv_blocks=num_kv_blocks, max_num_seqs=64, sim=sim, speculative_config=spec)
        runs[name] = (run(llm, prompts, params), {**llm.stats(), "busy_s": llm.timeline.busy_s_total})
    plain, plain_stats = runs["plain"]
    for name in ("overlap", "sync", "draft"):
        got, stats = runs[name]
        assert got == plain, name
        assert stats["spec_decode_mean_acceptance_length"] > 2.0  # 0.7 per draft: 2.8 expected of 4 drafts
        assert stats["steps"] < plain_stats["steps"]
        if num_kv_blocks == 40:
            assert stats["preemptions"] > 0
    # The same acceptance model, so about the same steps; each also pays the draft's forwards (0.1 of the target's
    # per forward, 1 + 4 of them a verify step: 1.26x and 1.45x the busy time measured here).
    assert runs["draft"][1]["busy_s"] > 1.15 * runs["overlap"][1]["busy_s"]


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


def test_sim_verify_steps_with_grammar_and_logprob_rows_give_the_plain_tokens(make_llm):
    """On ``sim`` with the default tokenizer: grammar rows (every case of the structured-output catalogue),
    logprob rows and plain rows share verify steps, all of them verifying drafts (a grammar row's token at each
    position picked under that position's mask: the plain chain where the grammar allows it, which is the
    sim's draft, returned with the step before, or for a draft model offered in the verify step itself).
    Tokens equal a run without speculation, in overlap and sync, with preemption, and every output its grammar
    finished satisfies it; grammar rows alone accept drafts too."""
    pytest.importorskip("xgrammar", reason="structured outputs need the structured extra")
    from harness.structured_cases import CASES

    sim = SimConfig(step_fixed_ms=0.2, per_token_us=0, per_context_token_ns=0, output_len_min=8, output_len_max=80)
    prompts, params = [], []
    for i in range(120):
        prompts.append(f"Request {i % 7}: say it again and again and again")
        if i % 3 == 0:
            case = CASES[(i // 3) % len(CASES)]
            params.append(SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured_outputs=case.params))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=60, temperature=0.0, seed=i, logprobs=1 if i % 2 else None))
        else:
            params.append(SamplingParams(max_tokens=60, temperature=0.0, seed=i))
    runs = {}
    draft = {"model": "smollm2-135m", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    modes = [("overlap", SPEC, True), ("sync", SPEC, False), ("draft", draft, True), ("draft-sync", draft, False)]
    for name, spec, overlap in [("plain", None, True), *modes]:
        llm = make_llm(device="sim", engine_process=False, overlap=overlap, debug_check_integrity=True,
                       num_kv_blocks=60, max_num_seqs=48, sim=sim, speculative_config=spec)
        # The grammar compiler loads the tokenizer once, a second or so; meanwhile the plain requests behind the
        # first grammar request would run alone. Loaded first, the grammar rows join their steps.
        llm.generate(["warm up"], SamplingParams(max_tokens=4, structured_outputs=CASES[0].params), use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle_and_clean(llm)
        runs[name] = ([(o.token_ids, o.finish_reason) for o in outs], llm.stats(), outs)
        shared = [r for r in llm.timeline.records if r.grammar_rows and r.spec_drafts]
        assert (len(shared) > 10) == (spec is not None), name  # steps where grammar rows and drafts met
        alone = llm.generate(prompts[::3], params[::3], use_tqdm=False)  # the grammar requests alone
        accepted = llm.stats()["spec_decode_num_accepted_tokens"] - runs[name][1]["spec_decode_num_accepted_tokens"]
        assert (accepted > 0) == (spec is not None), name
        runs[name] += ([o.token_ids for o in alone],)
    plain = runs["plain"][0]
    for name, _, _ in modes:
        got, stats, outs, alone = runs[name]
        assert got == plain and alone == runs["plain"][3], name
        assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["preemptions"] > 0, name
        stopped = 0
        for i, out in enumerate(outs):
            if i % 3 == 0 and out.finish_reason == "stop":
                CASES[(i // 3) % len(CASES)].check(out.text)
                stopped += 1
            if params[i].logprobs is not None:
                assert len(out.logprobs.logprobs) == len(out.token_ids)
        assert stopped >= 10, name
