"""Structured output on the host: a request's constraint compiled for one tokenizer, and per request a
matcher that fills its row of the token bitmask and advances on each sampled token.

``GrammarCompiler`` compiles ``StructuredOutputsParams`` (JSON schema, any JSON object, regex, choice,
grammar) with one of two libraries, xgrammar or llguidance (adapters: ``grammar_xgrammar``,
``grammar_libs``); a constraint the library cannot compile is a ``ValueError`` naming
``structured_outputs.<field>``.
Compiled grammars are kept in a bounded LRU on ``params.key()``; concurrent requests for the same key
compile it once. ``GrammarCompiler`` is thread-safe (the frontend validates on request threads, the
engine core makes matchers on its planner thread); a ``GrammarMatcher`` belongs to one thread at a time.

Bitmask layout (both libraries'): row ``r``, bit ``t % 32`` of int32 word ``t // 32`` is 1 iff token ``t``
may come next. Ids at or past the tokenizer's own vocabulary (a padded LM head) are never allowed, nor
are the tokenizer's special tokens; once the constraint is satisfied and cannot go on, only EOS is
allowed, so a constrained request ends with EOS (finish reason "stop").

The default library (``DEFAULT_BACKEND``) was chosen by measurement: coverage of
``scripts/harness/structured_cases.py`` first, then mask time per row
(``scripts/grammar_backends.py``, profiles/grammar-backends-amd-epyc-2core/README.md).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from asyncbatch.config import GRAMMAR_BACKENDS
from asyncbatch.sampling.grammar_libs import check_bitmask
from asyncbatch.sampling.token_bitmask import apply_bitmask_, bitmask_words, bits_set
from asyncbatch.structured_outputs import StructuredOutputsParams

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "GrammarCompiler", "GrammarMatcher", "allocate_bitmask", "apply_bitmask_",
           "bitmask_words", "resolve_backend"]

BACKENDS = GRAMMAR_BACKENDS  # "auto" takes the first one installed
DEFAULT_BACKEND = BACKENDS[0]
logger = logging.getLogger(__name__)
INSTALL_HINT = "pip install asyncbatch[structured]"
CACHE_ENTRIES = 128  # compiled grammars kept per compiler (xgrammar: 1-250 KB each at vocab 49k)
_REASON_CHARS = 300


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A zeroed int32 ``[rows, bitmask_words(vocab_size)]`` bitmask (nothing allowed)."""
    return np.zeros((rows, bitmask_words(vocab_size)), dtype=np.int32)


class GrammarMatcher(Protocol):
    """One request's position in its constraint (``grammar_libs`` has one class per library)."""

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False, with the state unchanged, if it is not allowed next."""

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write row ``row`` of an int32 ``[rows, bitmask_words(vocab_size)]`` C-contiguous array.

        After termination the row allows EOS alone."""

    def is_terminated(self) -> bool:
        """True once EOS was accepted (or the matcher broke and can accept nothing)."""

    def snapshot(self) -> tuple:
        """The adapter's own state beside the library's, for ``rollback``."""

    def rollback(self, num_tokens: int, snapshot: tuple) -> None:
        """Undo the last ``num_tokens`` accepted tokens (never EOS): back to when ``snapshot`` was taken."""


def resolve_backend(backend: str) -> str:
    """The library ``backend`` names ("auto": the first of ``BACKENDS`` installed), checked importable."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"grammar backend must be 'auto' or one of {', '.join(BACKENDS)}, got {backend!r}")
    wanted = BACKENDS if backend == "auto" else (backend,)
    for name in wanted:
        if importlib.util.find_spec(name) is not None:
            if backend == "auto" and name != DEFAULT_BACKEND:  # a fallback the user did not choose: say what it costs
                logger.warning("structured outputs use %s because %s is not installed (%s): its token masks cost "
                               "several times more host time a row (14x in scripts/bench_structured.py on a 2-core "
                               "Xeon, profiles/structured-output-sim-intel-xeon-2core)", name, DEFAULT_BACKEND,
                               INSTALL_HINT)
            return name
    raise ImportError(f"structured outputs need the {' or '.join(wanted)} library, which is not installed; "
                      f"install it with: {INSTALL_HINT}")


# xgrammar prefixes its C++ errors with "[12:34:56] /project/cpp/file.cc:123: ".
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _lib_class(name: str) -> type:
    """The adapter of library ``name``; imported here, so ``import asyncbatch`` never loads a library."""
    if name == "llguidance":
        from asyncbatch.sampling.grammar_libs import LLGuidanceLib

        return LLGuidanceLib
    from asyncbatch.sampling.grammar_xgrammar import XGrammarLib

    return XGrammarLib


def _reason(exc: BaseException) -> str:
    """The library's message, one line: its first lines up to ``_REASON_CHARS`` (a first line like
    "regex parse error:" says little alone), without xgrammar's source location."""
    lines = []
    for line in str(exc).splitlines()[:4]:
        if line.startswith("<"):  # llguidance's parser state dump follows
            break
        lines.append(line.strip())
    text = _LOG_PREFIX.sub("", " ".join(filter(None, lines))) or type(exc).__name__
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS] + "..."


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer. Thread-safe; compiled grammars are cached
    by ``params.key()`` in a bounded LRU (failures too, so a bad request repeated is not recompiled).

    ``vocab_size`` is the model's (the logits' width; may exceed the tokenizer's). ``eos_token_id``
    defaults to the tokenizer's. ``backend``: "auto", "xgrammar" or "llguidance".
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, backend: str = "auto",
                 cache_entries: int = CACHE_ENTRIES) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        if eos is None or not 0 <= eos < vocab_size:
            raise ValueError(f"structured outputs need an EOS token id in [0, {vocab_size}), got {eos!r}")
        self.backend_name: str = resolve_backend(backend)
        try:
            self._lib = _lib_class(self.backend_name)(tokenizer, vocab_size, int(eos))
        except ImportError as exc:
            raise ImportError(f"grammar backend {self.backend_name} failed to import ({_reason(exc)}); "
                              f"install it with: {INSTALL_HINT}") from exc
        self.vocab_size = vocab_size
        self.eos_token_id = int(eos)
        self._cache_entries = max(1, cache_entries)
        self._lock = threading.Lock()
        # key -> (compiled, None) or (None, error message); in-flight compiles: key -> Event
        self._cache: OrderedDict[tuple[str, str], tuple[Any, str | None]] = OrderedDict()
        self._pending: dict[tuple[str, str], threading.Event] = {}

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` (cached); ``ValueError`` "structured_outputs.<field> ..." if it cannot be."""
        self._compiled(params)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of ``params``' constraint (compiles it first if needed)."""
        return self._lib.matcher(self._compiled(params))

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray, rows: Sequence[int]) -> None:
        """``matchers[i].fill_bitmask(bitmask, rows[i])`` for all ``i`` (matchers of this compiler), in one
        library call where the library has one (xgrammar's batch fill runs on its own threads)."""
        fill_batch = getattr(self._lib, "fill_batch", None)
        if fill_batch is None or not matchers:
            for matcher, row in zip(matchers, rows):
                matcher.fill_bitmask(bitmask, row)
            return
        check_bitmask(bitmask, max(rows), bitmask_words(self.vocab_size))
        fill_batch(list(matchers), bitmask, list(rows))

    def fill_draft_masks(self, matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]],
                         bitmask: np.ndarray, first_rows: Sequence[int], width: int) -> None:
        """The masks of a verify step's positions past the first: row ``first_rows[i] + j`` (``0 < j < width``)
        gets ``matchers[i]``'s mask after its first ``j`` drafts (``drafts[i]``), as if they had been accepted.

        Each matcher walks its drafts, one batched accept and one batched fill a position, and is rolled back
        to where it was (row ``first_rows[i]``, the mask before any draft, is the caller's). A row's walk stops
        at a draft its grammar refuses (the mask before it forbids it, so the device's verification stops there
        too), at EOS (the request ends with it) and past its drafts: its rows from there on allow nothing, so a
        position without a mask can never emit a token."""
        n = len(matchers)
        for i in range(n):
            bitmask[first_rows[i] + 1:first_rows[i] + width] = 0
        saved = [m.snapshot() for m in matchers]
        walked = [0] * n
        live = list(range(n))
        for j in range(1, width):
            live = [i for i in live if len(drafts[i]) >= j and drafts[i][j - 1] != self.eos_token_id]
            tokens = [drafts[i][j - 1] for i in live]
            if live:
                # A draft the mask before it forbids is refused without asking the library: it is cheaper, and
                # xgrammar prints a warning for every special token it is offered (a draft model proposes them).
                rows = np.array([first_rows[i] + j - 1 for i in live], dtype=np.int64)
                allowed = bits_set(bitmask, rows, np.array(tokens, dtype=np.int64)).tolist()
                live = [i for i, ok in zip(live, allowed) if ok]
                tokens = [t for t, ok in zip(tokens, allowed) if ok]
            if not live:
                break
            accepted = self.accept_tokens([matchers[i] for i in live], tokens)
            live = [i for i, ok in zip(live, accepted) if ok]
            for i in live:
                walked[i] = j
            if live:
                self.fill_bitmasks([matchers[i] for i in live], bitmask, [first_rows[i] + j for i in live])
        for m, steps, snapshot in zip(matchers, walked, saved):
            m.rollback(steps, snapshot)

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        """``[m.accept(t) for m, t in zip(matchers, tokens)]``, in one library call where there is one."""
        accept_batch = getattr(self._lib, "accept_batch", None)
        if accept_batch is None:
            return [m.accept(t) for m, t in zip(matchers, tokens)]
        return accept_batch(list(matchers), [int(t) for t in tokens])

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def _compiled(self, params: StructuredOutputsParams) -> Any:
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"expected StructuredOutputsParams, got {type(params).__name__}")
        try:
            key = params.key()
        except RecursionError:
            raise ValueError("structured_outputs.json is nested too deeply") from None
        while True:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return self._result(params, hit)
                waiting = self._pending.get(key)
                if waiting is None:
                    self._pending[key] = threading.Event()
                    break
            waiting.wait()  # another thread compiles this key; its result is then in the cache
        try:
            entry = self._compile(params)
            with self._lock:
                self._cache[key] = entry
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        finally:
            with self._lock:
                self._pending.pop(key).set()
        return self._result(params, entry)

    def _compile(self, params: StructuredOutputsParams) -> tuple[Any, str | None]:
        try:
            return self._lib.compile(params), None
        except Exception as exc:  # noqa: BLE001 - any library failure on user input is the user's error
            return None, _reason(exc)

    def _result(self, params: StructuredOutputsParams, entry: tuple[Any, str | None]) -> Any:
        compiled, error = entry
        if error is not None:
            field = params.kind
            raise ValueError(f"structured_outputs.{field} cannot be compiled ({self.backend_name}): {error}")
        return compiled
