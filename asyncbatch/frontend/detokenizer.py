"""Incremental detokenization: turn one request's output tokens into text deltas.

Invariant: whenever the output so far ends on a complete character, the
concatenation of the deltas returned by :meth:`IncrementalDetokenizer.push` equals
``tokenizer.decode(output_ids, skip_special_tokens=...)``; after
:meth:`IncrementalDetokenizer.finish` it does so for any output. A delta is never
retracted: text that could still change is held back, not emitted and fixed later.

Each step decodes a small window ``[prefix tokens | new tokens]`` and emits what the
new tokens added to the prefix's decoding, holding back a window that ends in
U+FFFD (a split character); the window starts empty, not primed with the prompt.
The Rust ``DecodeStream`` does this when the tokenizer has a Rust backend, else
``_OffsetWindow``. Two documented cases stay inexact: a broken sentencepiece
byte-fallback run, and ``clean_up_tokenization_spaces``.

A request whose text nobody reads before it ends (not streamed, no stop
strings) gets a ``DeferredDetokenizer``: its ids are collected and decoded in
one call when it finishes, which is the reference the incremental deltas are
held to; an engine without a tokenizer gets a ``NullDetokenizer`` and the
output processor never calls it.

Specification: docs/detokenizer.md
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# What decoders produce for an incomplete UTF-8 sequence at the end of a window.
_REPLACEMENT = "\ufffd"


def rust_backend(tokenizer: Any) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (itself, or a transformers
    fast tokenizer's ``backend_tokenizer``), or None for a Python-only tokenizer."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Text deltas for one request's output tokens.

    Invariants:
    - ``text`` is the concatenation of every delta returned so far (push and finish).
    - ``output_ids[:emitted_upto]`` produced ``text``; later ids are held back
      (an incomplete character, or a token that decoded to nothing on its own).

    ``tokenizer`` is a transformers tokenizer or a ``tokenizers.Tokenizer``.
    ``prompt_token_ids`` is accepted for interface symmetry and not used (the
    window starts empty; docs/detokenizer.md explains why). Not thread-safe: one output thread owns it.
    """

    __slots__ = (
        "_backend",
        "_emitted_upto",
        "_output_ids",
        "_pending",
        "_pieces",
        "_skip",
        "_slow",
        "_stream",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._skip = skip_special_tokens
        self._backend = rust_backend(tokenizer)
        self._stream: DecodeStream | None = None
        self._slow: _OffsetWindow | None = None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        else:
            self._slow = _OffsetWindow(tokenizer, skip_special_tokens)
        self._output_ids: list[int] = []
        self._pieces: list[str] = []
        self._emitted_upto = 0
        # True when a token since the last delta may still add text, so finish()
        # has something to flush; skipped special tokens do not set it.
        self._pending = False

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        pieces = self._pieces
        if len(pieces) > 1:
            # Joined lazily: most callers stream the deltas and never read text.
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    @property
    def output_ids(self) -> list[int]:
        """The output token ids pushed so far (do not mutate)."""
        return self._output_ids

    def push(self, token_id: int) -> str:
        """Append one output token; return the text it made final (possibly "")."""
        self._output_ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._backend, token_id)
            except Exception as exc:  # tokenizers raises a bare Exception for this
                if "Invalid prefix" not in str(exc):
                    raise
                delta = self._restart_stream(token_id)
        else:
            delta = self._slow.push(token_id)
        if not delta:
            if not self._pending:
                self._pending = not self._is_skipped_special(token_id)
            return ""
        self._pending = False
        self._emitted_upto = len(self._output_ids)
        self._pieces.append(delta)
        return delta

    def finish(self) -> str:
        """Flush what is held back at the end of the request: what ``decode`` adds
        for an incomplete character (U+FFFD) or for a last token whose text waited
        on a successor. Returns "" when nothing is held back."""
        if not self._pending:
            return ""
        self._pending = False
        if self._stream is not None:
            # A full decode, once per request and only when something is held:
            # exact wherever decode extends what was emitted.
            full = self._backend.decode(self._output_ids, skip_special_tokens=self._skip)
            emitted = self.text
            tail = full[len(emitted) :] if full.startswith(emitted) else self._held_text()
        else:
            tail = self._slow.flush()
        self._emitted_upto = len(self._output_ids)
        if tail:
            self._pieces.append(tail)
        return tail

    def batch_backend(self) -> tuple[Tokenizer, bool] | None:
        """The Rust backend and ``skip_special_tokens`` whose ``decode_batch`` gives what ``decode_once`` gives
        (``decode_deferred``); None without a Rust backend."""
        return None if self._backend is None else (self._backend, self._skip)

    def decode_once(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` for a fresh detokenizer, in one call: what pushing each and then
        ``finish`` return together wherever ``decode`` extends what was emitted (the Rust backend decodes
        them at once; the Python window pushes them)."""
        if self._stream is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip) if token_ids else ""
        pieces = [self.push(token) for token in token_ids]
        return "".join(pieces) + self.finish()

    def _held_text(self) -> str:
        """The text of the held ids, decoded after the last emitted id for
        leading-space context."""
        ids = self._output_ids
        context = ids[max(self._emitted_upto - 1, 0) : self._emitted_upto]
        held = ids[self._emitted_upto :]
        head = self._backend.decode(context, skip_special_tokens=self._skip)
        both = self._backend.decode(context + held, skip_special_tokens=self._skip)
        if both.startswith(head):
            return both[len(head) :]
        return self._backend.decode(held, skip_special_tokens=self._skip)

    def _restart_stream(self, token_id: int) -> str:
        """Recover from DecodeStream's "invalid prefix" error; return the delta.

        DecodeStream raises when a window's decoding no longer extends its prefix's,
        which broken UTF-8 under ``ByteFallback`` causes (docs/detokenizer.md),
        on the token that ends the broken byte run. Emitted text is final, so the
        held ids, this one included, are rendered as they stand, and a new stream
        takes over, primed with this token for leading-space context.
        """
        delta = self._held_text()
        clean = not self._backend.decode([token_id], skip_special_tokens=self._skip).endswith(_REPLACEMENT)
        self._stream = DecodeStream(ids=[token_id] if clean else None, skip_special_tokens=self._skip)
        return delta

    def _is_skipped_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token that decoding drops entirely.

        Runs only for tokens that produced no text, so its cost stays off the
        common path. An unknown id counts as "may add text"; finish() checks.
        """
        if not self._skip:
            return False
        if self._backend is not None:
            backend = self._backend
            return backend.decode([token_id], skip_special_tokens=True) == "" and bool(
                backend.decode([token_id], skip_special_tokens=False)
            )
        return self._slow.is_skipped(token_id)


class _OffsetWindow:
    """vLLM's prefix/read-offset window over token strings, for Python tokenizers.

    Invariant: ``_tokens[:_read]`` decode to ``_prefix_text``, whose text was already
    emitted; ``_tokens[_read:]`` are held. Each emission drops the tokens before the
    old read offset, so a step decodes a handful of tokens, never the whole output.
    """

    __slots__ = ("_prefix_text", "_read", "_skip", "_skip_ids", "_tok", "_tokens")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Ids to drop, or None to let convert_ids_to_tokens decide per token.
        self._skip_ids = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._tokens: list[str] = []
        self._read = 0
        self._prefix_text = ""

    def push(self, token_id: int) -> str:
        if self._skip_ids is None:
            new = self._tok.convert_ids_to_tokens([token_id], skip_special_tokens=True)
            token = new[0] if new else None
        elif token_id in self._skip_ids:
            return ""
        else:
            token = self._tok.convert_ids_to_tokens(token_id)
        if token is None:  # a skipped special token, or an id outside the vocabulary
            return ""
        self._tokens.append(token)
        full = self._tok.convert_tokens_to_string(self._tokens)
        if len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT):
            return ""
        return self._advance(full)

    def flush(self) -> str:
        """What the held tokens add even if it ends in U+FFFD (end of request)."""
        if self._read == len(self._tokens):
            return ""
        full = self._tok.convert_tokens_to_string(self._tokens)
        return self._advance(full) if len(full) > len(self._prefix_text) else ""

    def is_skipped(self, token_id: int) -> bool:
        if self._skip_ids is not None:
            return token_id in self._skip_ids
        return self._skip and not self._tok.convert_ids_to_tokens([token_id], skip_special_tokens=True)

    def _advance(self, full: str) -> str:
        """Emit ``full`` beyond the prefix; the old read offset becomes the prefix start."""
        delta = full[len(self._prefix_text) :]
        self._tokens = self._tokens[self._read :]
        self._read = len(self._tokens)
        self._prefix_text = self._tok.convert_tokens_to_string(self._tokens)
        return delta


# Per-tokenizer special ids: transformers recomputes ``all_special_ids`` on each
# access (about 30 us for ByT5), too slow to pay per token or per request.
_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _special_ids(tokenizer: Any) -> frozenset[int] | None:
    """The ids ``decode(..., skip_special_tokens=True)`` drops, read once per
    tokenizer (special tokens added later are not seen); None if unknown."""
    try:
        return _SPECIAL_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is None:
        return None
    found = frozenset(ids)
    try:
        _SPECIAL_IDS[tokenizer] = found
    except TypeError:  # not weak-referenceable: recomputed per request
        pass
    return found


class NullDetokenizer:
    """The detokenizer of an engine without a tokenizer (``skip_tokenizer_init``): token ids only, no text."""

    __slots__ = ()
    text = ""

    def push(self, token_id: int) -> str:
        return ""

    def finish(self) -> str:
        return ""


class DeferredDetokenizer:
    """Text once, at the end: for a request nobody reads text from until it finishes (not streamed, no stop
    strings). ``ids`` collects the tokens to detokenize (the output processor appends to it directly on its
    fast path); ``finish`` decodes them in one call (``IncrementalDetokenizer.decode_once``) instead of one
    incremental step per token. Not thread-safe: one output thread owns it."""

    __slots__ = ("_finished", "_inner", "ids", "text")

    def __init__(self, inner: IncrementalDetokenizer) -> None:
        self._inner = inner
        self.ids: list[int] = []
        self.text = ""
        self._finished = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return ""

    def finish(self) -> str:
        """The whole text (once; "" after)."""
        if self._finished:
            return ""
        self._finished = True
        self.text = self._inner.decode_once(self.ids)
        return self.text

    def batch_backend(self) -> tuple[Tokenizer, bool] | None:
        """Where ``decode_deferred`` may decode this one with others (``IncrementalDetokenizer.batch_backend``);
        None when finished, empty, or without a Rust backend."""
        return None if self._finished or not self.ids else self._inner.batch_backend()

    def finish_with(self, text: str) -> None:
        """Finish with ``text``, decoded elsewhere from ``ids`` as ``finish`` would (``decode_deferred``)."""
        self._finished = True
        self.text = text


def decode_deferred(detokenizers: Sequence[DeferredDetokenizer]) -> list[str]:
    """``finish`` every one of ``detokenizers`` and return their texts, in order. Those sharing a Rust backend and
    ``skip_special_tokens`` are decoded by one ``decode_batch`` call: the same text as ``decode`` one by one, but
    with the GIL released and, unless ``TOKENIZERS_PARALLELISM`` is false, spread over the cores (``LLM.generate``
    decodes its outputs' texts this way once they are all in: docs/detokenizer.md)."""
    groups: dict[tuple[int, bool], tuple[Tokenizer, list[DeferredDetokenizer]]] = {}
    for detokenizer in detokenizers:
        key = detokenizer.batch_backend()
        if key is None:  # nothing to decode, already done, or a Python-only tokenizer: one at a time
            detokenizer.finish()
            continue
        backend, skip = key
        groups.setdefault((id(backend), skip), (backend, []))[1].append(detokenizer)
    for (_, skip), (backend, group) in groups.items():
        for detokenizer, text in zip(group, backend.decode_batch([d.ids for d in group], skip_special_tokens=skip)):
            detokenizer.finish_with(text)
    return [detokenizer.text for detokenizer in detokenizers]
