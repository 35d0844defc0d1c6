"""vLLM's ``allowed_token_ids`` and ``bad_words``: token masks filled under overlap like a grammar's.

The masks against a brute-force reading of the phrases (hypothesis), the tokenization rule, and engines on a tiny
random model (float32): every output inside the allowed set, no output containing a bad phrase where the
unconstrained output did, the same greedy tokens in overlap and sync mode, with and without speculation (n-gram,
and a draft model that walks its drafts on the device), and beside a grammar.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import save_tiny_model

from asyncbatch import SamplingParams, SimConfig, StructuredOutputsParams
from asyncbatch.engine.messages import CONSTRAINED_MESSAGE
from asyncbatch.errors import ConstraintConflictError
from asyncbatch.model.loader import load_tokenizer
from asyncbatch.sampling.token_bitmask import bits_set
from asyncbatch.sampling.token_constraints import TokenConstraint, bad_words_token_ids, walk_drafts

VOCAB = 40
WORDS = (VOCAB + 31) // 32


def _allowed(bitmask: np.ndarray, row: int) -> set[int]:
    ids = np.arange(VOCAB)
    return set(ids[bits_set(bitmask, np.full(VOCAB, row), ids)].tolist())


def _reference(outputs: list[int], phrases: list[list[int]], allowed: list[int] | None) -> set[int]:
    """What may come next, read off the definitions: in ``allowed`` (if given), and not the last token of a
    phrase whose other tokens the outputs end with."""
    banned = {p[-1] for p in phrases if len(p) - 1 <= len(outputs) and outputs[len(outputs) - len(p) + 1:] == p[:-1]}
    return {t for t in range(VOCAB) if (allowed is None or t in allowed) and t not in banned}


phrase_lists = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=5)


@settings(max_examples=300, deadline=None)
@given(phrases=phrase_lists, outputs=st.lists(st.integers(0, 5), max_size=8),
       allowed=st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
def test_the_mask_is_the_phrases_read_off_the_outputs(phrases, outputs, allowed):
    constraint = TokenConstraint(VOCAB, allowed, phrases)
    for i, token in enumerate(outputs):  # accepted exactly when the mask before it allowed it
        bitmask = np.full((1, WORDS), -1, dtype=np.int32)
        constraint.apply(bitmask, 0)
        assert _allowed(bitmask, 0) == _reference(outputs[:i], phrases, allowed)
        if token not in _allowed(bitmask, 0):
            assert not constraint.accept(token)
            return
        assert constraint.accept(token)


@settings(max_examples=200, deadline=None)
@given(phrases=phrase_lists, drafts=st.lists(st.integers(0, 5), max_size=4), width=st.integers(1, 5),
       seen=st.lists(st.integers(0, 5), max_size=3))
def test_a_draft_walk_masks_each_position_and_leaves_the_constraint_as_it_was(phrases, drafts, width, seen):
    constraint = TokenConstraint(VOCAB, None, phrases)
    for token in seen:
        if not constraint.accept(token):
            break
    before = list(constraint.outputs)
    bitmask = np.full((width + 1, WORDS), 7, dtype=np.int32)  # garbage past the first row: the walk writes them
    bitmask[0] = -1
    constraint.apply(bitmask, 0)
    walk_drafts(constraint, drafts, bitmask, 0, width, eos_token_id=5, narrow_only=False, vocab_size=VOCAB)
    assert constraint.outputs == before
    walked = before
    for j in range(1, width):
        previous = _allowed(bitmask, j - 1)
        if j > len(drafts) or drafts[j - 1] not in previous or drafts[j - 1] == 5:
            assert all(not _allowed(bitmask, k) for k in range(j, width))  # nothing past the walk
            break
        walked = walked + [drafts[j - 1]]
        assert _allowed(bitmask, j) == _reference(walked, phrases, None)
    assert (bitmask[width] == 7).all()  # the next row's masks are untouched


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("constraints") / "llama", "LlamaForCausalLM")


def test_bad_words_are_tokenized_as_they_stand_and_after_a_space(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    phrases = bad_words_token_ids(tokenizer, ["hello", " world"], 10**6)
    plain = tokenizer.encode("hello", add_special_tokens=False)
    spaced = tokenizer.encode(" hello", add_special_tokens=False)
    assert phrases[0] == plain
    assert (spaced in phrases) == (spaced[0] != plain[0] and len(spaced) == len(plain))
    assert tokenizer.encode("world", add_special_tokens=False) in phrases  # leading spaces are dropped first
    with pytest.raises(ValueError, match="bad_words token ids"):
        bad_words_token_ids(tokenizer, ["hello"], 1)


PROMPTS = [[5, 6, 7], [9, 3, 4, 5, 6], [11, 12], [20, 21, 22, 23], [8, 8, 8, 9]]


def _contains(tokens: list[int], phrase: list[int]) -> bool:
    n = len(phrase)
    return any(tokens[i:i + n] == phrase for i in range(len(tokens) - n + 1))


def _bad_words_seen(tokenizer, outputs) -> list[str]:
    """Words whose tokens the unconstrained outputs contain: one of one token, one of two or more."""
    found: dict[bool, str] = {}
    for out in outputs:
        ids = out.token_ids
        for k in range(len(ids) - 1):
            for span in (ids[k:k + 1], ids[k:k + 2]):
                word = tokenizer.decode(span).strip()
                if not word or word in found.values():
                    continue
                phrases = bad_words_token_ids(tokenizer, [word], 10**6)
                longest = max(len(p) for p in phrases)
                if (longest > 1) not in found and any(_contains(o.token_ids, p) for o in outputs for p in phrases):
                    found[longest > 1] = word
        if len(found) == 2:
            break
    assert len(found) == 2, found  # the tiny model's greedy outputs repeat themselves: both kinds are there
    return list(found.values())


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 1}, "draft_self"])
def test_constrained_greedy_tokens_obey_and_agree_in_every_mode(make_llm, tiny_model, speculative):
    if speculative == "draft_self":
        speculative = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3}
    tokenizer = load_tokenizer(tiny_model)
    greedy = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    reference = make_llm(str(tiny_model), device="cpu", dtype="float32", engine_process=False)
    plain = reference.generate(PROMPTS, SamplingParams(**greedy), use_tqdm=False)
    words = _bad_words_seen(tokenizer, plain)
    seen = sorted({t for out in plain for t in out.token_ids})
    allowed = sorted(set(range(3, 60)) - set(seen[: len(seen) // 2]))  # half the tokens greedy picked are out
    params = ([SamplingParams(**greedy, bad_words=words)] * len(PROMPTS)
              + [SamplingParams(**greedy, allowed_token_ids=allowed)] * len(PROMPTS)
              + [SamplingParams(**greedy, bad_words=words, allowed_token_ids=allowed + [2])]
              + [SamplingParams(max_tokens=24, temperature=1.0, seed=4, bad_words=words)])
    prompts = PROMPTS * 2 + PROMPTS[:2]
    results = {}
    for overlap in (True, False):
        # One engine-core process: the tokenized words travel to it with the parameters.
        llm = make_llm(str(tiny_model), device="cpu", dtype="float32", overlap=overlap,
                       engine_process=speculative is None and overlap, speculative_config=speculative,
                       debug_check_integrity=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[overlap] = [o.token_ids for o in outs]
        for out, p, before in zip(outs, params, plain * 2 + plain[:2]):
            assert out.finish_reason in ("length", "stop"), (p, out.finish_reason, out.error)
            if p.bad_words:
                phrases = bad_words_token_ids(tokenizer, p.bad_words, 10**6)
                assert phrases and not any(_contains(out.token_ids, phrase) for phrase in phrases)
                assert p.bad_words_token_ids is None  # the caller's params are left as they were
            if p.allowed_token_ids:
                assert set(out.token_ids) <= set(p.allowed_token_ids)
        changed = [out.token_ids != before.token_ids for out, before in zip(outs[:len(PROMPTS)], plain)]
        assert any(changed)  # the bad words were in the plain outputs: the masks acted
    assert results[True] == results[False]
    if speculative is not None:  # greedy tokens do not depend on speculation
        plain_engine = make_llm(str(tiny_model), device="cpu", dtype="float32", engine_process=False)
        greedy_rows = len(params) - 1
        expected = [o.token_ids for o in plain_engine.generate(prompts[:greedy_rows], params[:greedy_rows],
                                                               use_tqdm=False)]
        assert results[True][:greedy_rows] == expected


@pytest.mark.parametrize("speculative", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                                         "draft_self"], ids=["ngram", "draft_self"])
def test_a_phrase_is_banned_at_the_position_after_its_draft(make_llm, tiny_model, speculative):
    """The tiny model repeats characters ("jj", "))", "%%"), which n-gram and self drafts propose: a verify step
    checks a draft "j" and, at the position after it, must already ban the second "j" (the host's walk along
    the drafts). A mask copied from the row's first position would let the repeat through (the constraint then
    refuses the token: an error). Tokens equal the plain engine's with the same words, overlap and sync."""
    if speculative == "draft_self":
        speculative = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3}
    tokenizer = load_tokenizer(tiny_model)
    words = ["jj", "))", "%%"]
    phrases = bad_words_token_ids(tokenizer, words, 10**6)
    assert all(len(p) == 2 for p in phrases)
    greedy = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    plain = make_llm(str(tiny_model), device="cpu", dtype="float32", engine_process=False)
    before = plain.generate(PROMPTS, SamplingParams(**greedy), use_tqdm=False)
    assert sum(_contains(o.token_ids, p) for o in before for p in phrases) >= 3
    expected = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(**greedy, bad_words=words),
                                                    use_tqdm=False)]
    for overlap in (True, False):
        llm = make_llm(str(tiny_model), device="cpu", dtype="float32", engine_process=False, overlap=overlap,
                       speculative_config=speculative, debug_check_integrity=True)
        outs = llm.generate(PROMPTS, SamplingParams(**greedy, bad_words=words), use_tqdm=False)
        assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS), [o.error for o in outs]
        assert not any(_contains(o.token_ids, p) for o in outs for p in phrases)
        assert [o.token_ids for o in outs] == expected
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 1}], ids=["plain", "ngram"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_constraints_that_exclude_each_other_end_that_request_with_a_clear_error(make_llm, tiny_model, speculative,
                                                                                  overlap):
    """``allowed_token_ids=["j"]`` with ``bad_words=["jj"]``: after one "j" nothing is left to sample. That request
    ends with an error naming the constraints (``ConstraintConflictError`` when streamed; HTTP 400 in the
    server), after its one token, never with a banned one; its neighbours finish as they would alone."""
    llm = make_llm(str(tiny_model), device="cpu", dtype="float32", engine_process=False, overlap=overlap,
                   speculative_config=speculative, debug_check_integrity=True)
    (j,) = load_tokenizer(tiny_model).encode("j", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    conflict = SamplingParams(max_tokens=16, temperature=0.0, allowed_token_ids=[j], bad_words=["jj"])
    grammar = SamplingParams(max_tokens=16, temperature=1.0, seed=1, bad_words=["a"],
                             structured_outputs=StructuredOutputsParams(choice=["a"]))
    outs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], [greedy, conflict, greedy, grammar],
                        use_tqdm=False)
    assert [o.token_ids for o in (outs[0], outs[2])] == [o.token_ids for o in alone]
    for out, tokens in ((outs[1], [j]), (outs[3], [])):
        assert out.finish_reason == "error" and out.error == CONSTRAINED_MESSAGE, (out.finish_reason, out.error)
        assert out.token_ids == tokens
    with pytest.raises(ConstraintConflictError, match="exclude each other"):
        list(llm.stream(PROMPTS[2], conflict))
    assert llm.generate(PROMPTS[:2], greedy, use_tqdm=False)[1].token_ids == alone[1].token_ids


def test_a_constraint_narrows_a_grammar(make_llm, tiny_model):
    """A grammar and ``allowed_token_ids`` together: the grammar's mask ANDed with the allowed set."""
    llm = make_llm(str(tiny_model), device="cpu", dtype="float32", engine_process=False)
    tokenizer = load_tokenizer(tiny_model)
    digits = sorted({t for d in "0123456789" for t in tokenizer.encode(d, add_special_tokens=False)})
    odd = [t for d, t in zip("0123456789", digits) if int(d) % 2] if len(digits) == 10 else digits[1::2]
    grammar = StructuredOutputsParams(regex="[0-9]{4}")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=1.0, seed=2, structured_outputs=grammar,
                                                   allowed_token_ids=odd + [tokenizer.eos_token_id]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop", (out.finish_reason, out.error)
    assert len(out.text) == 4 and all(int(c) % 2 for c in out.text), out.text


def test_allowed_token_ids_on_the_sim_device_without_a_tokenizer(make_llm):
    """The ``sim`` device picks inside masks, so its tokens obey too; an engine without a tokenizer keeps
    ``allowed_token_ids`` and refuses ``bad_words`` (they need the tokenizer), naming the field."""
    llm = make_llm("smollm2-135m", device="sim", sim=SimConfig(step_fixed_ms=0.2), skip_tokenizer_init=True,
                   debug_check_integrity=True, engine_process=False)
    allowed = [[100 + i, 2000 + 7 * i, 30000 + i] for i in range(64)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, allowed_token_ids=ids) for ids in allowed]
    plain = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, i] for i in range(65)], params + [plain], use_tqdm=False)
    for out, ids in zip(outs, allowed):
        assert len(out.token_ids) == 20 and set(out.token_ids) <= set(ids)
    assert not set(outs[-1].token_ids) <= set(allowed[-1])  # the plain row is not masked
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, bad_words=["no"]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, allowed_token_ids=[10**7]), use_tqdm=False)
    assert llm.generate([[5, 6]], plain, use_tqdm=False)[0].finish_reason == "length"
