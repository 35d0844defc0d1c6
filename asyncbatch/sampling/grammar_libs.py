"""The grammar libraries behind ``asyncbatch.sampling.grammar``: what both adapters share, and llguidance's.

An adapter (``LLGuidanceLib`` here, ``grammar_xgrammar.XGrammarLib``) turns ``StructuredOutputsParams`` into
a ``Compiled`` (``compile``, which raises whatever the library raises; ``grammar.GrammarCompiler`` makes
that a ``ValueError``) and a ``Compiled`` into a fresh matcher (``matcher``). Imported only when a compiler
is built, so ``import asyncbatch`` never loads either library.

Shared choices, so both libraries accept the same outputs:

- JSON is generated in ``json.dumps``' default layout: one line, ``", "`` and ``": "`` between items and
  after keys, no other whitespace (free whitespace lets a small model loop on blanks forever);
- the tokenizer's special tokens (``<s>``, ``<|im_start|>``, ...) are never allowed inside the text; the
  EOS token is allowed exactly when the constraint is satisfied;
- ``grammar`` takes GBNF/EBNF (``root ::= ...``) or Lark (``start: ...``) on both;
- the start state's row is computed once at compile time and copied into each new request's first
  fill (a library's first mask can take milliseconds: xgrammar's for ``[a-z]{1,8}@...`` ~1.6 ms).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncbatch.sampling.token_bitmask import bitmask_words
from asyncbatch.structured_outputs import StructuredOutputsParams

# llguidance's own test for Lark syntax (llguidance.gbnf_to_lark.is_lark_syntax).
LARK_SYNTAX = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def special_token_ids(tokenizer: Any) -> set[int]:
    """The ids ``decode(skip_special_tokens=True)`` drops: special tokens and special added tokens."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    for idx, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(idx))
    return ids


def check_bitmask(bitmask: np.ndarray, row: int, words: int) -> None:
    """The row a library writes through a raw pointer must exist: checked before handing it out."""
    if not isinstance(bitmask, np.ndarray) or bitmask.dtype != np.int32 or bitmask.ndim != 2:
        raise TypeError("bitmask must be an int32 numpy array [rows, bitmask_words(vocab_size)]")
    if bitmask.shape[1] != words or not bitmask.flags.c_contiguous:
        raise ValueError(f"bitmask must be C-contiguous with {words} words per row, got shape {bitmask.shape}")
    if not 0 <= row < bitmask.shape[0]:
        raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """A bool ``[V]`` array as one int32 bitmask row."""
    words = bitmask_words(len(allowed))
    packed = np.packbits(allowed, bitorder="little")
    return np.pad(packed, (0, words * 4 - len(packed))).view("<i4").astype(np.int32)


@dataclass(frozen=True, slots=True)
class Compiled:
    grammar: Any  # the library's compiled form (llguidance: a matcher at the start state, to copy)
    start: np.ndarray  # int32 [W]: the start state's row


class Matcher:
    """A request's matcher: the library's own, plus what both adapters do around it (the start row from
    the compile, the EOS-only row once terminated, range checks). Subclasses: ``_accept``, ``_fill``,
    ``is_terminated``."""

    __slots__ = ("_eos", "_m", "_start", "_vocab_size", "_words")

    def __init__(self, matcher: Any, compiled: Compiled, eos: int, vocab_size: int) -> None:
        self._m, self._eos, self._vocab_size = matcher, eos, vocab_size
        self._words = bitmask_words(vocab_size)
        self._start: np.ndarray | None = compiled.start  # until the first token

    def accept(self, token_id: int) -> bool:
        token_id = int(token_id)
        if not 0 <= token_id < self._vocab_size or self.is_terminated() or not self._accept(token_id):
            return False
        self._start = None
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        check_bitmask(bitmask, row, self._words)
        if not self.fill_without_library(bitmask, row):
            self._fill(bitmask, row)

    def fill_without_library(self, bitmask: np.ndarray, row: int) -> bool:
        """Write the row if the library is not needed for it (the start state's copy, or EOS only once
        terminated); False if it is."""
        if self._start is not None:
            bitmask[row] = self._start
        elif self.is_terminated():  # the row should not be sampled any more; if it is, it can only end
            bitmask[row] = 0
            bitmask[row].view(np.uint32)[self._eos >> 5] = np.uint32(1 << (self._eos & 31))
        else:
            return False
        return True

    _tracked: tuple[str, ...] = ("_start",)  # what the adapter tracks beside the library's state

    def snapshot(self) -> tuple:
        """The adapter's own state (``_tracked``), for ``rollback``."""
        return tuple(getattr(self, name) for name in self._tracked)

    def rollback(self, num_tokens: int, snapshot: tuple) -> None:
        """Undo the last ``num_tokens`` accepted tokens (never EOS), back to the state ``snapshot`` was taken in
        (``GrammarCompiler.fill_draft_masks`` walks a row's drafts and comes back)."""
        if num_tokens:
            self._m.rollback(num_tokens)
        for name, value in zip(self._tracked, snapshot):
            setattr(self, name, value)

    def is_terminated(self) -> bool:
        raise NotImplementedError

    def _accept(self, token_id: int) -> bool:
        raise NotImplementedError

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        raise NotImplementedError


class LLGuidanceMatcher(Matcher):
    __slots__ = ("_done",)
    _tracked = ("_start", "_done")

    def __init__(self, matcher: Any, compiled: Compiled, eos: int, vocab_size: int) -> None:
        super().__init__(matcher, compiled, eos, vocab_size)
        self._done = False

    def _accept(self, token_id: int) -> bool:
        if token_id == self._eos:  # try_consume_tokens never takes EOS
            self._done = self._m.is_accepting() and self._m.consume_token(token_id)
            return self._done
        # try_consume_tokens leaves the state as it was on a refused token (consume_token would put the
        # matcher into its error state for good).
        return self._m.try_consume_tokens([token_id]) == 1

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        self._m.unsafe_compute_mask_ptr(bitmask.ctypes.data + row * bitmask.strides[0], self._words * 4)

    def is_terminated(self) -> bool:
        return self._done or bool(self._m.is_error())


class LLGuidanceLib:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int) -> None:
        import llguidance
        import llguidance.hf

        self._llg, self.eos, self.vocab_size = llguidance, eos, vocab_size
        # Special tokens come from the tokenizer's JSON: llguidance never matches them as text.
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        # Same layout as xgrammar's with any_whitespace=False; a schema's "x-guidance" may still override.
        self._json_options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def _grammar(self, params: StructuredOutputsParams) -> str:
        M, kind = self._llg.LLMatcher, params.kind
        if kind in ("json", "json_object"):
            schema = params.schema_text if kind == "json" else JSON_OBJECT_SCHEMA
            if json.loads(schema) is True:  # the schema that allows anything; the options need an object
                schema = "{}"
            return M.grammar_from_json_schema(schema, defaults=self._json_options)
        if kind == "regex":
            return M.grammar_from_regex(params.regex)
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                              for c in params.choice))
        text = params.grammar or ""
        if not text.strip():
            raise ValueError("the grammar is empty")
        return self._llg.grammar_from("grammar", text)

    def compile(self, params: StructuredOutputsParams) -> Compiled:
        matcher = self._llg.LLMatcher(self._tokenizer, self._grammar(params), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        # The first mask also builds the lexer, which the copies share: here, not on the planner thread.
        start = np.zeros((bitmask_words(self.vocab_size),), dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(start.ctypes.data, start.nbytes)
        start.flags.writeable = False
        return Compiled(matcher, start)  # every request's matcher is a copy of this one

    def matcher(self, compiled: Compiled) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.grammar.deep_copy(), compiled, self.eos, self.vocab_size)
