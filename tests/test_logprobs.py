"""Log-probabilities of sampled and prompt tokens against a transformers forward (float32).

Every returned number (a sampled token's logprob, each top-k entry, each prompt
position's) must equal ``log_softmax`` of a transformers forward over the same
tokens within ``TOL``; a rank must agree with the reference distribution and the
top-k ids must be the k best (ties aside). Logprobs are of the model's raw
distribution, so the rows with penalties, temperature or top-k/top-p are judged
against the same raw reference.

The tiny-model engines chunk prompts (``max_num_batched_tokens=16``, prompts up
to 4x that); the overlap engine runs in its own process (logprobs cross a pickle),
the synchronous one in this process. Both run the same mixed batch, which must
give the same tokens and logprobs, and the same tokens as the batch without any
logprob rows.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from engine_checks import assert_idle_and_clean
from reference import logits_at
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM

from asyncbatch import LLM, SamplingParams
from asyncbatch.outputs import Logprobs, RequestOutput

TOL = 1e-4  # engine vs transformers (float32, different summation orders: ~2e-6 measured)
SAME_TOL = 1e-5  # two runs of the engine (overlap vs sync, preempted vs not)

TINY_ENGINE = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 16, "max_num_seqs": 8,
               "block_size": 4, "num_threads": 1}


def raw_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of transformers' logits at every position of ``token_ids``: ``[len, V]`` float64
    (row ``p`` scores the token at ``p + 1``)."""
    return torch.log_softmax(logits_at(model, token_ids), dim=-1)


def assert_logprobs_match(got: Logprobs, ref: torch.Tensor, token_ids: list[int], k: int, what: str) -> None:
    """``got`` scores ``token_ids`` (entry i under the reference row ``ref[i]``, ``[len(token_ids), V]``):
    values within ``TOL``, ranks consistent with the reference, top-k = the k best."""
    n = len(token_ids)
    assert got.token_ids == token_ids, what
    assert len(got.logprobs) == len(got.ranks) == len(got.top_token_ids) == len(got.top_logprobs) == n, what
    assert ref.shape[0] == n
    if n == 0:
        return
    chosen = ref.gather(1, torch.tensor(token_ids)[:, None])  # [n, 1]
    # rank = 1 + tokens strictly more likely; tokens within TOL of the chosen one may fall either side
    lowest = (1 + (ref > chosen + TOL).sum(1)).tolist()  # [n]
    highest = (ref >= chosen - TOL).sum(1).tolist()  # [n]
    best = ref.topk(k, dim=1).values.tolist() if k else [[]] * n  # [n, k]
    for i, token in enumerate(token_ids):
        where = f"{what} entry {i} (token {token})"
        ref_lp = float(chosen[i, 0])
        assert abs(got.logprobs[i] - ref_lp) <= TOL, f"{where}: logprob {got.logprobs[i]} vs reference {ref_lp}"
        assert lowest[i] <= got.ranks[i] <= highest[i], (
            f"{where}: rank {got.ranks[i]}, reference [{lowest[i]}, {highest[i]}]")
        ids, lps = got.top_token_ids[i], got.top_logprobs[i]
        assert len(ids) == len(lps) == k, f"{where}: {len(ids)} top entries for k={k}"
        if k == 0:
            continue
        assert len(set(ids)) == k, f"{where}: repeated top ids {ids}"
        assert all(a >= b for a, b in itertools.pairwise(lps)), f"{where}: top logprobs not descending {lps}"
        at_ids = ref[i, ids].tolist()
        assert all(abs(a - b) <= TOL for a, b in zip(lps, at_ids)), (
            f"{where}: top logprobs {lps} vs reference at those ids {at_ids}")
        assert all(abs(a - b) <= TOL for a, b in zip(lps, best[i])), (
            f"{where}: top ids {ids} are not the {k} best (reference best {best[i]})")
        if token in ids:
            assert abs(lps[ids.index(token)] - got.logprobs[i]) <= SAME_TOL, where


def check_against_reference(model, out: RequestOutput, params: SamplingParams, refs: dict | None = None) -> None:
    """Every logprob of ``out`` (sampled and prompt) against one transformers forward of prompt + output."""
    prompt, tokens = out.prompt_token_ids, out.token_ids
    assert (out.logprobs is None) == (params.logprobs is None)
    assert (out.prompt_logprobs is None) == (params.prompt_logprobs is None)
    if out.logprobs is None and out.prompt_logprobs is None:
        return
    key = (tuple(prompt), tuple(tokens))
    if refs is None or key not in refs:
        ref = raw_logprobs(model, prompt + tokens)
        if refs is not None:
            refs[key] = ref
    else:
        ref = refs[key]
    p = len(prompt)
    if out.logprobs is not None:
        assert len(out.logprobs) == len(tokens)
        # output token i sits at position p + i and is scored by the logits at p + i - 1
        assert_logprobs_match(out.logprobs, ref[p - 1:p - 1 + len(tokens)], tokens, params.logprobs,
                              f"{out.request_id} logprobs")
    if out.prompt_logprobs is not None:
        assert len(out.prompt_logprobs) == p - 1, f"{out.request_id}: {len(out.prompt_logprobs)} prompt entries"
        assert_logprobs_match(out.prompt_logprobs, ref[:p - 1], prompt[1:], params.prompt_logprobs,
                              f"{out.request_id} prompt_logprobs")


def assert_same_logprobs(a: Logprobs | None, b: Logprobs | None, what: str) -> None:
    """Two runs of the engine: same tokens, ranks and top ids; values within ``SAME_TOL``."""
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.token_ids == b.token_ids, what
    assert a.ranks == b.ranks, what
    assert a.top_token_ids == b.top_token_ids, what
    assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) <= SAME_TOL, what
    for x, y in zip(a.top_logprobs, b.top_logprobs):
        assert len(x) == len(y) and all(abs(u - v) <= SAME_TOL for u, v in zip(x, y)), what


# -- the tiny model ------------------------------------------------------------------------------------------


def _prompt(i: int, n: int) -> list[int]:
    return [3 + (i * 37 + j * 11) % 290 for j in range(n)]


# (prompt length, params): greedy and random rows, with and without logprobs, prompts from 1 token to 4x the
# step budget (chunked), k from 0 to 20, and rows whose sampling distribution is not the raw one.
MIXED = [
    (64, SamplingParams(max_tokens=10, temperature=0.0, logprobs=5, prompt_logprobs=3, ignore_eos=True)),
    (23, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)),
    (50, SamplingParams(max_tokens=12, temperature=1.0, seed=7, logprobs=2, prompt_logprobs=0, ignore_eos=True)),
    (9, SamplingParams(max_tokens=16, temperature=0.7, top_k=5, seed=3, logprobs=0, ignore_eos=True)),
    (37, SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0,
                        logprobs=20, prompt_logprobs=20, ignore_eos=True)),
    (17, SamplingParams(max_tokens=8, temperature=1.0, seed=11, prompt_logprobs=5, ignore_eos=True)),
    (1, SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, prompt_logprobs=2, ignore_eos=True)),
    (33, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.8, seed=5, logprobs=3)),
]
MIXED_PROMPTS = [_prompt(i, n) for i, (n, _) in enumerate(MIXED)]
MIXED_PARAMS = [p for _, p in MIXED]


def without_logprobs(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, logprobs=None, prompt_logprobs=None)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM")


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype="float32").eval()


@pytest.fixture(scope="module")
def tiny_engines(tiny_dir):
    """overlap: in its own process (the default); sync: in this process (``engine_process=False``)."""
    engines = {"overlap": LLM(str(tiny_dir), overlap=True, engine_process=True, **TINY_ENGINE),
               "sync": LLM(str(tiny_dir), overlap=False, engine_process=False, **TINY_ENGINE)}
    yield engines
    for llm in engines.values():
        llm.close()


@pytest.fixture(scope="module")
def mixed_runs(tiny_engines):
    """The mixed batch on each engine, run once per module."""
    runs = {}
    for mode, llm in tiny_engines.items():
        runs[mode] = llm.generate(MIXED_PROMPTS, MIXED_PARAMS, use_tqdm=False)
        assert_idle_and_clean(llm)
    return runs


@pytest.fixture(scope="module")
def tiny_refs() -> dict:
    return {}


@pytest.mark.parametrize("mode", ["overlap", "sync"])
def test_tiny_mixed_batch_logprobs_match_transformers(mixed_runs, tiny_reference, tiny_refs, mode):
    outs = mixed_runs[mode]
    for out, params in zip(outs, MIXED_PARAMS):
        check_against_reference(tiny_reference, out, params, tiny_refs)
    by_row = dict(enumerate(outs))
    # greedy rows without penalties pick the raw argmax: rank 1 (no near-tie in this workload)
    assert set(by_row[0].logprobs.ranks) == {1} and set(by_row[6].logprobs.ranks) == {1}
    # the raw distribution, not the sampler's: random and penalised rows pick tokens the raw model ranks lower
    for row in (2, 4, 7):
        assert max(by_row[row].logprobs.ranks) > 1, f"row {row} ranks {by_row[row].logprobs.ranks}"
    assert max(by_row[3].logprobs.ranks) <= 5, "top_k=5 leaves only the raw top 5 (no penalties on this row)"
    assert all(len(ids) == 0 for ids in by_row[3].logprobs.top_token_ids)  # logprobs=0: the chosen token only
    # a one-token prompt has no scored position; the 64-token prompt spans 4 chunks of 16
    assert by_row[6].prompt_logprobs is not None and len(by_row[6].prompt_logprobs) == 0
    assert len(by_row[0].prompt_logprobs) == 63
    assert by_row[1].logprobs is None and by_row[5].logprobs is None and by_row[5].prompt_logprobs is not None
    assert [len(o.token_ids) for o in outs[:7]] == [p.max_tokens for p in MIXED_PARAMS[:7]]


def test_overlap_equals_sync(mixed_runs):
    for i, (a, b) in enumerate(zip(mixed_runs["overlap"], mixed_runs["sync"])):
        assert a.token_ids == b.token_ids, f"request {i}"
        assert a.finish_reason == b.finish_reason, f"request {i}"
        assert_same_logprobs(a.logprobs, b.logprobs, f"request {i} logprobs")
        assert_same_logprobs(a.prompt_logprobs, b.prompt_logprobs, f"request {i} prompt_logprobs")


@pytest.mark.parametrize("mode", ["overlap", "sync"])
def test_logprob_rows_change_no_tokens(tiny_engines, mixed_runs, mode):
    llm = tiny_engines[mode]
    plain = llm.generate(MIXED_PROMPTS, [without_logprobs(p) for p in MIXED_PARAMS], use_tqdm=False)
    assert [o.token_ids for o in plain] == [o.token_ids for o in mixed_runs[mode]]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)
    assert_idle_and_clean(llm)


def test_preemption_keeps_tokens_and_logprobs(tiny_dir, tiny_reference, tiny_refs, mixed_runs):
    """A cache too small for the batch preempts and recomputes requests: the same tokens as the roomy run
    (with and without logprob rows), every prompt position scored exactly once, the same values."""
    with LLM(str(tiny_dir), overlap=True, engine_process=False, debug_check_integrity=True,
             num_kv_blocks=40, **TINY_ENGINE) as tight:
        outs = tight.generate(MIXED_PROMPTS, MIXED_PARAMS, use_tqdm=False)
        assert tight.stats()["preemptions"] > 0, "the cache was meant to be too small"
        assert_idle_and_clean(tight)
        plain = tight.generate(MIXED_PROMPTS, [without_logprobs(p) for p in MIXED_PARAMS], use_tqdm=False)
    roomy = mixed_runs["sync"]
    for i, (out, ref_out, params) in enumerate(zip(outs, roomy, MIXED_PARAMS)):
        assert out.token_ids == ref_out.token_ids, f"request {i}"
        assert plain[i].token_ids == ref_out.token_ids, f"request {i} without logprobs"
        assert_same_logprobs(out.logprobs, ref_out.logprobs, f"request {i} logprobs")
        assert_same_logprobs(out.prompt_logprobs, ref_out.prompt_logprobs, f"request {i} prompt_logprobs")
        check_against_reference(tiny_reference, out, params, tiny_refs)


def test_prompt_logprobs_after_a_prefix_cache_hit(tiny_engines, tiny_reference, tiny_refs):
    """A request asking for prompt logprobs computes its whole prompt even where the cache holds its prefix."""
    llm = tiny_engines["sync"]
    prompt = _prompt(40, 45)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], plain, use_tqdm=False)[0]
    before = llm.prefix_cache_stats()["cached_tokens"]
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=4, logprobs=2)
    out = llm.generate([prompt], scored, use_tqdm=False)[0]
    assert out.token_ids == first.token_ids
    check_against_reference(tiny_reference, out, scored, tiny_refs)
    assert llm.prefix_cache_stats()["cached_tokens"] == before, "prompt logprobs need the whole prompt computed"
    cached = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    again = llm.generate([prompt], cached, use_tqdm=False)[0]
    assert again.token_ids == first.token_ids
    check_against_reference(tiny_reference, again, cached, tiny_refs)  # sampled logprobs after a cache hit
    assert llm.prefix_cache_stats()["cached_tokens"] > before, "the cache was meant to hold this prompt"
    assert_idle_and_clean(llm)


@pytest.mark.parametrize("mode", ["overlap", "sync"])
def test_streamed_logprobs_add_up_to_the_final_ones(tiny_engines, tiny_reference, tiny_refs, mode):
    llm = tiny_engines[mode]
    for i, params in enumerate([
        SamplingParams(max_tokens=15, temperature=0.0, logprobs=3, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=21, logprobs=0, stop=["\x00\x01never"]),
    ]):
        prompt = _prompt(50 + i, 30)
        streamed = Logprobs()
        tokens: list[int] = []
        final = None
        prompt_lps = []  # the first delta with tokens carries the prompt's logprobs, when asked for
        for delta in llm.stream(prompt, params):
            if delta.token_ids:
                assert delta.logprobs is not None and delta.logprobs.token_ids == delta.token_ids, delta
                streamed.extend(delta.logprobs)
                prompt_lps.append(delta.prompt_logprobs)
                tokens += delta.token_ids
            else:
                assert not delta.logprobs, delta
            if delta.finish_reason is not None:
                final = delta.output
        assert final is not None and final.token_ids == tokens
        assert len(final.logprobs) == len(tokens) == len(streamed)
        assert streamed == final.logprobs
        assert all(lp is None for lp in prompt_lps[1:])
        if params.prompt_logprobs is None:
            assert prompt_lps[0] is None
        else:
            assert prompt_lps[0] == final.prompt_logprobs and len(prompt_lps[0]) == len(prompt) - 1
        check_against_reference(tiny_reference, final, params, tiny_refs)
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert alone.token_ids == tokens
        assert_same_logprobs(alone.logprobs, final.logprobs, "stream vs generate")
    assert_idle_and_clean(llm)


def test_sim_backend_returns_one_entry_per_token():
    """The simulated device has no distribution: pseudo logprobs (chosen 0.0, rank 1), right counts."""
    with LLM(device="sim", engine_process=False) as llm:
        prompts = [[300 + i for i in range(n)] for n in (1, 7, 40)]
        params = SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, prompt_logprobs=2)
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            assert out.simulated
            assert len(out.logprobs) == len(out.token_ids) > 0
            assert out.logprobs.token_ids == out.token_ids
            assert set(out.logprobs.logprobs) == {0.0} and set(out.logprobs.ranks) == {1}
            assert all(len(ids) == 3 for ids in out.logprobs.top_token_ids)
            assert out.prompt_logprobs.token_ids == prompt[1:]
            assert all(len(ids) == 2 for ids in out.prompt_logprobs.top_token_ids)


# -- the default model ---------------------------------------------------------------------------------------

LONG_TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil and "
             "a cloth for the lens. Ships passing the rocky headland relied on the beam to find the harbour "
             "entrance, and in forty years of service he had never once let the light go out, not even during "
             "the great storm that tore the roof from the boathouse.")


@pytest.fixture(scope="module")
def default_model():
    """The default model (float32), in its own process, prompts chunked by 24 tokens; and its transformers twin."""
    llm = LLM(device="cpu", dtype="float32", max_num_batched_tokens=24, max_num_seqs=4, num_threads=1)
    reference = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype="float32").eval()
    yield llm, reference
    llm.close()


@pytest.mark.model
def test_default_model_logprobs_match_transformers(default_model):
    llm, reference = default_model
    prompts = [llm.tokenizer.encode(LONG_TEXT), llm.tokenizer.encode("The three primary colours are")]
    assert len(prompts[0]) > 3 * 24, len(prompts[0])  # several chunks of prefill
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, prompt_logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=1, logprobs=3, prompt_logprobs=1,
                             ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        check_against_reference(reference, out, p, None)
    assert set(outs[0].logprobs.ranks) == {1}
    assert len(outs[0].prompt_logprobs) == len(prompts[0]) - 1
    # the prompt is English: its tokens are far likelier than chance under the model (not an off-by-one)
    assert sum(outs[0].prompt_logprobs.logprobs) / len(prompts[0]) > -6.0
    assert_idle_and_clean(llm)
