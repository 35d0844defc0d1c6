"""The structured-output grammar layer (``asyncbatch.sampling.grammar``) on both libraries.

Mostly on the tiny byte-level tokenizer (259 ids in a 300-id model vocabulary: ids 0-2 are
``<unk> <s> </s>``, EOS 2; 259-299 are padding), where a random walk through the allowed tokens is cheap;
one test on the default model's tokenizer (49,152 ids). The cases are the catalogue's
(``scripts/harness/structured_cases.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from harness.structured_cases import BAD_CASES, CASES, CASES_BY_NAME, EXTRA_CASES, EXTRA_VIOLATIONS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import EOS_ID, TINY_VOCAB, build_byte_tokenizer

from asyncbatch.sampling import grammar
from asyncbatch.sampling.grammar import (
    BACKENDS,
    DEFAULT_BACKEND,
    GrammarCompiler,
    allocate_bitmask,
    apply_bitmask_,
    bitmask_words,
)
from asyncbatch.sampling.token_bitmask import bits_set
from asyncbatch.structured_outputs import StructuredOutputsParams

TOKENIZER_IDS = 259  # ids the byte-level tokenizer has; the rest of TINY_VOCAB is padding
SPECIAL = (0, 1)  # <unk>, <s>: never allowed; EOS (2) only at the end
PARAMS = [pytest.param(b, marks=pytest.mark.skipif(importlib.util.find_spec(b) is None,
                                                  reason=f"{b} is not installed"), id=b) for b in BACKENDS]


@pytest.fixture(scope="module")
def byte_tokenizer():
    return build_byte_tokenizer()


_compilers: dict[str, GrammarCompiler] = {}


@pytest.fixture(params=PARAMS)
def compiler(request, byte_tokenizer) -> GrammarCompiler:
    """One compiler per library for the module (its cache is part of what is tested)."""
    if request.param not in _compilers:
        _compilers[request.param] = GrammarCompiler(byte_tokenizer, TINY_VOCAB, EOS_ID, backend=request.param)
    return _compilers[request.param]


def allowed(bitmask: np.ndarray, row: int = 0, vocab: int = TINY_VOCAB) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:vocab])


def walk(compiler, tokenizer, case, seed: int, steps: int = 200) -> tuple[list[int], bool]:
    """A random walk through the allowed tokens; (the ids before EOS, whether it ended). Checks on every
    step: no special or padding id is allowed, the chosen token is accepted, and whenever EOS is allowed
    the text so far satisfies the case."""
    rng = random.Random(seed)
    matcher = compiler.matcher(case.params)
    bitmask = allocate_bitmask(1, TINY_VOCAB)
    ids: list[int] = []
    for _ in range(steps):
        matcher.fill_bitmask(bitmask, 0)
        ok = allowed(bitmask)
        assert len(ok), f"{case.name}: nothing allowed after {tokenizer.decode(ids)!r}"
        assert not set(ok.tolist()) & {*SPECIAL, *range(TOKENIZER_IDS, TINY_VOCAB)}, case.name
        if EOS_ID in ok:
            case.check(tokenizer.decode(ids))
        token = int(ok[rng.randrange(len(ok))])
        assert matcher.accept(token), f"{case.name}: allowed token {token} refused"
        if matcher.is_terminated():
            assert token == EOS_ID
            return ids, True
        ids.append(token)
    return ids, False


def test_the_catalogue_has_what_the_tests_need():
    kinds = [case.params.kind for case in CASES]
    assert len(CASES) >= 24 and len({case.name for case in CASES}) == len(CASES)
    assert kinds.count("json") >= 14 and kinds.count("regex") >= 5 and kinds.count("choice") >= 3
    assert kinds.count("json_object") >= 1 and kinds.count("grammar") >= 2
    assert {field for field, _ in BAD_CASES} == {"json", "regex", "choice", "grammar"}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_case_compiles_and_random_walks_end_in_valid_text(compiler, byte_tokenizer, case):
    compiler.validate(case.params)
    ended = 0
    for seed in range(8):
        ids, done = walk(compiler, byte_tokenizer, case, seed)
        if done:
            case.check(byte_tokenizer.decode(ids))
            ended += 1
            if ended == 2:
                break
    assert ended, f"{case.name}: no walk of 200 tokens reached EOS in 8 tries"


@pytest.mark.parametrize("case", EXTRA_CASES, ids=[case.name for case in EXTRA_CASES])
def test_extra_schema_features_are_enforced_or_refused(compiler, byte_tokenizer, case):
    try:
        compiler.validate(case.params)
    except ValueError as exc:
        assert str(exc).startswith("structured_outputs.json cannot be compiled")
        return
    for text in EXTRA_VIOLATIONS.get(case.name, ()):
        matcher = compiler.matcher(case.params)
        ids = byte_tokenizer.encode(text, add_special_tokens=False)
        assert not (all(matcher.accept(t) for t in ids) and matcher.accept(EOS_ID)), f"{text!r} got through"
    for seed in range(4):
        ids, done = walk(compiler, byte_tokenizer, case, seed)
        if done:
            case.check(byte_tokenizer.decode(ids))


@pytest.mark.parametrize("name", ["json_person", "regex_email", "choice_prefixes", "grammar_arithmetic"])
def test_bitmask_agrees_with_accept_and_refusals_change_nothing(compiler, byte_tokenizer, name):
    case, rng = CASES_BY_NAME[name], random.Random(1)
    bitmask, again = allocate_bitmask(2, TINY_VOCAB), allocate_bitmask(2, TINY_VOCAB)
    prefix: list[int] = []
    for _ in range(8):
        matcher = compiler.matcher(case.params)
        assert all(matcher.accept(t) for t in prefix)
        matcher.fill_bitmask(bitmask, 1)
        bits = set(allowed(bitmask, 1).tolist())
        for token in [*rng.sample(range(TINY_VOCAB), 40), *bits]:
            if token in bits:
                continue
            assert not matcher.accept(token)  # refused: and the state is as it was
        matcher.fill_bitmask(again, 1)
        assert np.array_equal(bitmask[1], again[1])
        for token in rng.sample(sorted(bits), min(len(bits), 12)):  # each allowed one is accepted
            probe = compiler.matcher(case.params)
            assert all(probe.accept(t) for t in prefix) and probe.accept(token)
        if EOS_ID in bits and len(bits) == 1:
            break
        prefix.append(rng.choice(sorted(bits - {EOS_ID}) or [EOS_ID]))
    assert bitmask[0].tolist() == [0] * bitmask_words(TINY_VOCAB)  # other rows untouched


def _random_tokens(compiler, case, rng: random.Random, length: int, after: tuple[int, ...] = ()) -> list[int]:
    """Up to ``length`` tokens the case allows after ``after``, chosen at random (EOS never; fewer only where
    the constraint allows nothing else)."""
    matcher, bitmask, ids = compiler.matcher(case.params), allocate_bitmask(1, TINY_VOCAB), []
    assert all(matcher.accept(t) for t in after)
    for _ in range(length):
        matcher.fill_bitmask(bitmask, 0)
        choices = sorted(set(allowed(bitmask).tolist()) - {EOS_ID})
        if not choices:
            break
        ids.append(rng.choice(choices))
        assert matcher.accept(ids[-1])
    return ids


def _walk_drafts(compiler, cases, prefixes, drafts, width: int) -> tuple[list, list[int], np.ndarray]:
    """A matcher per case after its prefix, and a verify step's masks of them (``width`` rows each, in a bitmask
    that held stale bits): the first row of each by ``fill_bitmasks``, the rest by ``fill_draft_masks``."""
    matchers = []
    for case, prefix in zip(cases, prefixes):
        matcher = compiler.matcher(case.params)
        assert all(matcher.accept(t) for t in prefix)
        matchers.append(matcher)
    first = [i * width for i in range(len(cases))]
    bitmask = np.full((len(cases) * width, bitmask_words(TINY_VOCAB)), 7, dtype=np.int32)
    compiler.fill_bitmasks(matchers, bitmask, first)
    compiler.fill_draft_masks(matchers, drafts, bitmask, first, width)
    return matchers, first, bitmask


def test_draft_masks_follow_the_drafts_and_the_matchers_come_back(compiler, byte_tokenizer, capfd):
    """``fill_draft_masks`` (a verify step's masks past the first position): row ``j`` of a matcher's rows is its
    mask after its first ``j`` drafts, as a matcher fed the same tokens has it; from a refused draft (a special or
    padding id included: a draft model proposes those), an EOS or the end of the drafts on, its rows allow
    nothing; and every matcher is back where it was (same mask, same tokens accepted next). Several matchers at
    once, in one batch, as the engine calls it. The library is never offered a draft the mask forbids (xgrammar
    prints a warning for each special one)."""
    rng, width = random.Random(5), 5
    names = ("json_person", "regex_email", "choice_prefixes", "grammar_arithmetic", "json_person", "json_person",
             "choice_yes_no", "regex_email")
    cases = [CASES_BY_NAME[n] for n in names]
    prefixes = [_random_tokens(compiler, case, rng, rng.randrange(0, 6)) for case in cases]
    drafts = [_random_tokens(compiler, case, rng, width - 1, tuple(prefix)) for case, prefix in zip(cases, prefixes)]
    assert len(drafts[4]) == len(drafts[5]) == width - 1  # a JSON object has room for four more tokens
    drafts[4][2] = 0  # <unk>: never allowed, so the walk stops before it
    drafts[5][1] = EOS_ID  # the walk stops at an EOS draft (the request ends with it)
    drafts[6] = []  # no drafts: only the first row is the matcher's
    drafts[7][1] = TINY_VOCAB - 20  # a padding id (the model's, not the tokenizer's)
    walks = [len(d) for d in drafts[:4]] + [2, 1, 0, 1]
    matchers, first, bitmask = _walk_drafts(compiler, cases, prefixes, drafts, width)
    assert "cannot accept" not in capfd.readouterr().err
    expected = allocate_bitmask(1, TINY_VOCAB)
    for i, (case, prefix, walked) in enumerate(zip(cases, prefixes, walks)):
        reference = compiler.matcher(case.params)
        assert all(reference.accept(t) for t in prefix)
        for j in range(width):
            row = bitmask[first[i] + j]
            if j > walked:
                assert not row.any(), (case.name, j)  # past the walk: nothing allowed
                continue
            reference.fill_bitmask(expected, 0)
            assert np.array_equal(row, expected[0]), (case.name, j)
            if j < walked:
                assert reference.accept(drafts[i][j])
        matchers[i].fill_bitmask(expected, 0)
        assert np.array_equal(expected[0], bitmask[first[i]]), case.name  # back at its state before the walk
        if walked:  # and it goes on from there like any matcher
            assert matchers[i].accept(drafts[i][0])
            matchers[i].fill_bitmask(expected, 0)
            assert np.array_equal(expected[0], bitmask[first[i] + 1]), case.name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), width=st.integers(2, 6))
def test_draft_masks_match_a_matcher_fed_the_drafts_for_any_drafts(compiler, seed, width):
    """The walk of ``fill_draft_masks`` for random batches: rows of random cases at random points, whose drafts
    mix tokens the constraint allows, random ids and EOS. Each row's masks up to where its walk stops equal a
    fresh matcher's fed the same drafts, the rows after allow nothing, and every matcher comes back."""
    rng = random.Random(seed)
    cases = [rng.choice(CASES) for _ in range(rng.randint(1, 6))]
    prefixes = [_random_tokens(compiler, case, rng, rng.randint(0, 8)) for case in cases]
    drafts = []
    for case, prefix in zip(cases, prefixes):
        valid = _random_tokens(compiler, case, rng, width - 1, tuple(prefix))
        drafts.append([t if rng.random() < 0.7 else (EOS_ID if rng.random() < 0.3 else rng.randrange(TINY_VOCAB))
                       for t in valid[:rng.randint(0, len(valid))]])
    matchers, first, bitmask = _walk_drafts(compiler, cases, prefixes, drafts, width)
    expected = allocate_bitmask(1, TINY_VOCAB)
    for i, (case, prefix) in enumerate(zip(cases, prefixes)):
        reference = compiler.matcher(case.params)
        assert all(reference.accept(t) for t in prefix)
        walking = True
        for j in range(width):
            row = bitmask[first[i] + j]
            if not walking:
                assert not row.any(), (case.name, j, drafts[i])
                continue
            reference.fill_bitmask(expected, 0)
            assert np.array_equal(row, expected[0]), (case.name, j, drafts[i])
            walking = j < len(drafts[i]) and drafts[i][j] != EOS_ID and reference.accept(drafts[i][j])
        matchers[i].fill_bitmask(expected, 0)
        assert np.array_equal(expected[0], bitmask[first[i]]), (case.name, drafts[i])


def test_one_batch_accepts_a_matchers_tokens_in_order(compiler, byte_tokenizer):
    """A verify step's row feeds its matcher several tokens in one batched call (``GrammarState.advance``): the
    library takes them in order, as one call each would."""
    rng = random.Random(9)
    for name in ("json_person", "regex_email", "grammar_arithmetic"):
        case = CASES_BY_NAME[name]
        tokens = _random_tokens(compiler, case, rng, 12)
        batched, single = compiler.matcher(case.params), compiler.matcher(case.params)
        other = compiler.matcher(CASES_BY_NAME["choice_yes_no"].params)
        yes = byte_tokenizer.encode("yes", add_special_tokens=False)
        mixed = [batched] * 6 + [other] + [batched] * (len(tokens) - 6)
        assert all(compiler.accept_tokens(mixed, tokens[:6] + yes[:1] + tokens[6:]))
        assert all(single.accept(t) for t in tokens)
        masks = allocate_bitmask(2, TINY_VOCAB)
        batched.fill_bitmask(masks, 0)
        single.fill_bitmask(masks, 1)
        assert np.array_equal(masks[0], masks[1]), name


def test_after_eos_only_eos_and_nothing_is_accepted(compiler, byte_tokenizer):
    matcher = compiler.matcher(CASES_BY_NAME["choice_yes_no"].params)
    assert not matcher.accept(EOS_ID)  # not complete yet
    for t in byte_tokenizer.encode("no", add_special_tokens=False):
        assert matcher.accept(t)
    bitmask = allocate_bitmask(1, TINY_VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed(bitmask).tolist() == [EOS_ID]  # complete and cannot go on: EOS alone
    assert not matcher.is_terminated() and matcher.accept(EOS_ID) and matcher.is_terminated()
    assert not matcher.accept(EOS_ID) and not matcher.accept(byte_tokenizer.encode("a")[0])
    matcher.fill_bitmask(bitmask, 0)
    assert allowed(bitmask).tolist() == [EOS_ID]
    assert not matcher.accept(-1) and not matcher.accept(TINY_VOCAB) and not matcher.accept(10**12)


def test_json_follows_the_schemas_property_order(compiler, byte_tokenizer):
    ids, done = walk(compiler, byte_tokenizer, CASES_BY_NAME["json_person"], seed=0)
    assert done and byte_tokenizer.decode(ids).startswith('{"name": "')


def test_a_bad_bitmask_is_refused_not_written(compiler):
    matcher = compiler.matcher(CASES_BY_NAME["regex_phone"].params)
    with pytest.raises(TypeError):
        matcher.fill_bitmask(np.zeros((1, bitmask_words(TINY_VOCAB)), dtype=np.int64), 0)
    with pytest.raises(ValueError):
        matcher.fill_bitmask(np.zeros((1, bitmask_words(TINY_VOCAB) - 1), dtype=np.int32), 0)
    with pytest.raises(IndexError):
        matcher.fill_bitmask(allocate_bitmask(2, TINY_VOCAB), 2)


@pytest.mark.parametrize(("field", "kwargs"), BAD_CASES,
                         ids=[f"{i}-{field}" for i, (field, _) in enumerate(BAD_CASES)])
def test_bad_input_is_a_value_error_naming_the_field(compiler, field, kwargs):
    for _ in range(2):  # the second from the cache
        with pytest.raises(ValueError, match=rf"^structured_outputs\.{field}\b") as info:
            compiler.validate(StructuredOutputsParams(**kwargs))
        assert len(str(info.value)) < 500


def test_the_reason_comes_from_the_library(compiler):
    with pytest.raises(ValueError, match=r"wibble"):
        compiler.validate(StructuredOutputsParams(json={"type": "wibble"}))
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex cannot be compiled \(\w+\): \S"):
        compiler.validate(StructuredOutputsParams(regex="(abc"))


def test_validate_from_four_threads_compiles_once(byte_tokenizer):
    compiler = GrammarCompiler(byte_tokenizer, TINY_VOCAB, EOS_ID)
    good = StructuredOutputsParams(json={"type": "object", "properties": {"t": {"type": "integer"}}})
    bad = StructuredOutputsParams(regex="(unclosed")
    barrier, errors, outcomes = threading.Barrier(4), [], []

    def run() -> None:
        try:
            barrier.wait()
            for _ in range(20):
                compiler.validate(good)
                compiler.matcher(good)
                try:
                    compiler.validate(bad)
                except ValueError as exc:
                    outcomes.append(str(exc).startswith("structured_outputs.regex"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and outcomes == [True] * 80 and compiler.cache_len() == 2


def test_the_cache_is_bounded(byte_tokenizer):
    compiler = GrammarCompiler(byte_tokenizer, TINY_VOCAB, EOS_ID, cache_entries=2)
    for word in ("a", "b", "c"):
        compiler.validate(StructuredOutputsParams(regex=word))
    assert compiler.cache_len() == 2


def test_backend_names_and_a_missing_library(byte_tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="grammar backend must be"):
        GrammarCompiler(byte_tokenizer, TINY_VOCAB, EOS_ID, backend="outlines")
    if importlib.util.find_spec(DEFAULT_BACKEND) is not None:
        assert GrammarCompiler(byte_tokenizer, TINY_VOCAB, EOS_ID).backend_name == DEFAULT_BACKEND
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(byte_tokenizer, TINY_VOCAB, TINY_VOCAB)
    monkeypatch.setattr(grammar.importlib.util, "find_spec", lambda name: None)
    for backend in ("auto", *BACKENDS):
        with pytest.raises(ImportError, match=r"pip install asyncbatch\[structured\]"):
            GrammarCompiler(byte_tokenizer, TINY_VOCAB, EOS_ID, backend=backend)


def test_auto_says_so_when_it_falls_back_from_the_default_library(monkeypatch, caplog):
    real = grammar.importlib.util.find_spec
    monkeypatch.setattr(grammar.importlib.util, "find_spec", lambda name: None if name == DEFAULT_BACKEND else real(name))
    fallback = next(b for b in BACKENDS if b != DEFAULT_BACKEND)
    if real(fallback) is None:
        pytest.skip(f"{fallback} is not installed")
    with caplog.at_level(logging.WARNING, logger=grammar.__name__):
        assert grammar.resolve_backend("auto") == fallback
        assert grammar.resolve_backend(fallback) == fallback  # asked for by name: no warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and DEFAULT_BACKEND in warnings[0] and "asyncbatch[structured]" in warnings[0]


def test_importing_asyncbatch_loads_no_grammar_library():
    code = ("import sys, asyncbatch, asyncbatch.sampling.grammar; "
            "assert not {'xgrammar', 'llguidance'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for g in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[g, t // 32]) >> (t % 32)) & 1:
                out[g, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 300])
@pytest.mark.parametrize("extra_words", [0, 2])
def test_apply_bitmask_matches_a_reference(vocab, extra_words):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen)
    words = bitmask_words(vocab) + extra_words
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed (bit 31 included)
    bitmask[2] = 0  # nothing allowed
    expected = _reference_apply(logits, bitmask)
    apply_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isneginf(logits[2]).all() and not torch.isinf(logits[1]).any()


def test_bits_set_reads_the_mask_as_apply_does():
    """The host's test of one token per row (``bits_set``, the draft walk's) agrees with the mask the sampler
    applies, bit 31 included; ids past the mask's words or negative are never allowed."""
    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1
    bitmask[2] = 0
    allowed_ = torch.isfinite(_reference_apply(torch.zeros(4, 96), bitmask))
    rows = np.repeat(np.arange(4), 100)
    tokens = np.tile(np.arange(-2, 98), 4)
    expected = [0 <= t < 96 and bool(allowed_[r, t]) for r, t in zip(rows.tolist(), tokens.tolist())]
    assert bits_set(bitmask.numpy(), rows, tokens).tolist() == expected


def test_apply_bitmask_checks_shapes_and_masks_half_precision():
    with pytest.raises(ValueError, match="words per row"):
        apply_bitmask_(torch.zeros(1, 65), torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(TypeError):
        apply_bitmask_(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    logits = torch.zeros(1, 40, dtype=torch.bfloat16)
    apply_bitmask_(logits, torch.tensor([[1 << 5, 1 << 7]], dtype=torch.int32))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5, 39]


@pytest.fixture(scope="module")
def default_tokenizer():
    from asyncbatch.model.default_model import DefaultModelMissingError
    from asyncbatch.model.loader import load_tokenizer, resolve_model_path

    try:
        return load_tokenizer(resolve_model_path(None))
    except DefaultModelMissingError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("backend", PARAMS)
def test_default_model_tokenizer_padded_vocab_and_special_tokens(default_tokenizer, backend):
    """49,152 ids padded to 49,216: padding and special ids are never allowed, and the mask agrees with
    accept for allowed and disallowed samples along a walk."""
    vocab = 49152 + 64
    eos = default_tokenizer.eos_token_id
    special = {i for i in grammar_special_ids(default_tokenizer) if i != eos}
    compiler = GrammarCompiler(default_tokenizer, vocab, eos, backend=backend)
    rng = random.Random(0)
    bitmask = allocate_bitmask(1, vocab)
    for name in ("json_person", "regex_date", "choice_unicode", "grammar_fruit_list"):
        case = CASES_BY_NAME[name]
        matcher, ids = compiler.matcher(case.params), []
        for _ in range(24):
            matcher.fill_bitmask(bitmask, 0)
            bits = allowed(bitmask, vocab=vocab)
            assert len(bits) and bits[-1] < 49152 and not special & set(bits.tolist()), name
            refused = [t for t in rng.sample(range(vocab), 64) if t not in set(bits.tolist())]
            assert not any(matcher.accept(t) for t in refused)
            token = int(bits[rng.randrange(len(bits))])
            assert matcher.accept(token)
            if matcher.is_terminated():
                text = default_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                case.check(text)
                break
            ids.append(token)


@pytest.fixture(scope="module")
def control_token_ids(default_tokenizer) -> set[int]:
    """The default tokenizer's ids (below 49,152, special ones left out) whose text holds a control character."""
    special = grammar_special_ids(default_tokenizer) | {default_tokenizer.eos_token_id}
    return {i for i in range(49152) if i not in special
            and any(ord(ch) < 0x20 for ch in default_tokenizer.decode([i], skip_special_tokens=False))}


@pytest.mark.parametrize("backend", PARAMS)
def test_json_strings_never_allow_a_control_character_token(default_tokenizer, control_token_ids, backend):
    """Inside a JSON string every state allows string text but no token holding a control character (U+0000 to
    U+001F: JSON forbids them raw); xgrammar would allow some there, so its JSON grammars are compiled against a
    vocabulary without them. Checked at the start of a string value and along it, on the default tokenizer."""
    vocab, control = 49152, control_token_ids
    assert control  # newline, tab and friends are tokens of their own, and parts of others
    compiler = GrammarCompiler(default_tokenizer, vocab, default_tokenizer.eos_token_id, backend=backend)
    # A bounded string: xgrammar's rule for it is the one that takes control characters (0.2.9).
    params = StructuredOutputsParams(json={"type": "object", "properties": {"note": {"type": "string", "maxLength": 400}},
                                           "required": ["note"], "additionalProperties": False})
    matcher = compiler.matcher(params)
    bitmask, rng, ids, inside = allocate_bitmask(1, vocab), random.Random(2), [], 0
    for _ in range(24):  # a walk into the string value and along it (no quote once inside: it stays open)
        matcher.fill_bitmask(bitmask, 0)
        ok = set(allowed(bitmask, vocab=vocab).tolist())
        assert ok and not ok & control
        if default_tokenizer.decode(ids).count('"') == 3:  # the key's two quotes and the value's opening one
            inside += 1
            assert len(ok) > 100  # string text is allowed (no escape is started: no backslash is taken)
            ok = {t for t in ok if not {'"', "\\"} & set(default_tokenizer.decode([t]))}  # the string stays open
        token = rng.choice(sorted(ok))
        assert matcher.accept(token)
        ids.append(token)
    assert inside >= 10


def grammar_special_ids(tokenizer) -> set[int]:
    from asyncbatch.sampling.grammar_libs import special_token_ids

    return special_token_ids(tokenizer)


XGRAMMAR_PUBLIC = pytest.param("xgrammar-public", id="xgrammar-public-wrappers", marks=pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"))


@pytest.mark.parametrize("backend", [*PARAMS, XGRAMMAR_PUBLIC])
def test_batched_fill_and_accept_equal_one_row_at_a_time(default_tokenizer, backend, monkeypatch):
    """``fill_bitmasks`` and ``accept_tokens`` (xgrammar: one library call each) do exactly what per-row
    ``fill_bitmask`` and ``accept`` do, for rows at the start state, mid-walk (UTF-8 repairs
    included) and terminated, in any row order: two sets of matchers walk the same tokens, one each way.
    ``xgrammar-public``: without the private FFI entry points the wrapper uses (another xgrammar version),
    through xgrammar's public batch calls."""
    if backend == "xgrammar-public":
        import xgrammar.base

        monkeypatch.setattr(xgrammar.base, "_core", object())  # no BatchGrammarMatcher: the fallback
        backend = "xgrammar"
    vocab = 49152
    compiler = GrammarCompiler(default_tokenizer, vocab, default_tokenizer.eos_token_id, backend=backend)
    cases = [c for c in CASES if c.params.kind in ("json", "json_object", "regex", "grammar")][:12]
    one_by_one = [compiler.matcher(c.params) for c in cases]
    batched = [compiler.matcher(c.params) for c in cases]
    rng = random.Random(1)
    single, together = allocate_bitmask(len(cases), vocab), allocate_bitmask(len(cases), vocab)
    rows = list(range(len(cases)))[::-1]  # rows need not follow the matchers' order
    for step in range(24):
        for matcher, row in zip(one_by_one, rows):
            matcher.fill_bitmask(single, row)
        together[:] = 0
        compiler.fill_bitmasks(batched, together, rows)
        np.testing.assert_array_equal(together, single, err_msg=f"step {step}")
        tokens = []
        for row in rows:
            ok = allowed(single, row, vocab)
            # Now and then a disallowed token: both ways must refuse it and stay where they were.
            tokens.append(int(ok[rng.randrange(len(ok))]) if len(ok) and rng.random() > 0.1 else rng.randrange(vocab))
        expected = [m.accept(t) for m, t in zip(one_by_one, tokens)]
        assert compiler.accept_tokens(batched, tokens) == expected
        assert [m.is_terminated() for m in batched] == [m.is_terminated() for m in one_by_one]


@pytest.mark.parametrize("vocab", [49152, 49152 + 32, 100])  # an even and an odd number of words, a small one
def test_the_sim_devices_pick_takes_only_allowed_tokens(vocab):
    """``sim_executor.allowed_pick`` (the simulated sampler of grammar rows) returns an allowed token for
    every row that allows any, token 0 for a row that allows none, spreads its picks over a dense row by
    the hash, and reads row slices that are not contiguous."""
    from asyncbatch.executors.sim_executor import allowed_pick, mix64

    rng = np.random.default_rng(0)
    rows, words = 96, allocate_bitmask(1, vocab).shape[1]
    bitmask = allocate_bitmask(rows, vocab)
    edges = [0, 31, 32, 63, 64, vocab - 1] + rng.integers(0, vocab, 20).tolist()
    for g in range(rows):
        kind = g % 4
        if kind == 0 and g // 4 < len(edges):  # one allowed token, at a word's edge or anywhere
            token = edges[g // 4]
            bitmask[g, token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        elif kind == 1:  # a few allowed tokens
            for token in rng.integers(0, vocab, 3):
                bitmask[g, token // 32] |= np.int32(np.uint32(1 << (int(token) % 32)).view(np.int32))
        elif kind == 2:  # most allowed (a string's contents)
            bitmask[g] = rng.integers(-2**31, 2**31, words, dtype=np.int64).astype(np.int32)
        # kind 3 (and kind 0 past the edges): nothing allowed
    bitmask[:, -1] &= np.int32(np.uint32((1 << (vocab % 32)) - 1 if vocab % 32 else 0xFFFFFFFF).view(np.int32))
    for view in (bitmask, bitmask[::2]):
        for seed in range(4):
            h = mix64(np.arange(len(view), dtype=np.uint64) * np.uint64(7919) + np.uint64(seed))
            picks = allowed_pick(view, h)
            for g, token in enumerate(picks.tolist()):
                ok = allowed(view, g, vocab)
                assert (token in ok.tolist()) if len(ok) else token == 0, (vocab, g, token)
    dense = np.full((64, words), -1, dtype=np.int32)
    picks = allowed_pick(dense, mix64(np.arange(64, dtype=np.uint64)))
    assert len(set(picks.tolist())) > 48
    # ``chain_or_pick`` (a grammar row's sim token): the row's plain token where its bitmask row allows it, an
    # allowed pick elsewhere; bitmask rows chosen by ``rows`` (a verify step's position of each row).
    from asyncbatch.executors.sim_executor import chain_or_pick

    order = rng.permutation(rows)
    chain = rng.integers(0, vocab, rows)
    chain[::3] = [int(allowed(bitmask, g, vocab)[0]) if len(allowed(bitmask, g, vocab)) else 0 for g in order[::3]]
    h = mix64(np.arange(rows, dtype=np.uint64))
    got = chain_or_pick(bitmask, order, chain, h)
    for i, (g, token) in enumerate(zip(order.tolist(), got.tolist())):
        ok = allowed(bitmask, g, vocab).tolist()
        if chain[i] in ok:
            assert token == chain[i]
        else:
            assert (token in ok) if ok else token == 0


@pytest.mark.parametrize("backend", PARAMS)
def test_batched_accept_refuses_out_of_range_tokens_alone(default_tokenizer, backend):
    """A token outside the vocabulary in ``accept_tokens`` is refused for its row only; the other rows
    advance as they would one at a time."""
    vocab = 49152
    compiler = GrammarCompiler(default_tokenizer, vocab, default_tokenizer.eos_token_id, backend=backend)
    params = StructuredOutputsParams(regex="[a-z]+")
    batched = [compiler.matcher(params) for _ in range(3)]
    one_by_one = [compiler.matcher(params) for _ in range(3)]
    token = default_tokenizer.encode("abc", add_special_tokens=False)[0]
    tokens = [token, vocab, -1]
    assert compiler.accept_tokens(batched, tokens) == [m.accept(t) for m, t in zip(one_by_one, tokens)] \
        == [True, False, False]
    mask_a, mask_b = allocate_bitmask(3, vocab), allocate_bitmask(3, vocab)
    compiler.fill_bitmasks(batched, mask_a, [0, 1, 2])
    for g, m in enumerate(one_by_one):
        m.fill_bitmask(mask_b, g)
    np.testing.assert_array_equal(mask_a, mask_b)
