"""xgrammar behind ``asyncbatch.sampling.grammar`` (see ``grammar_libs`` for what both adapters share).

xgrammar 0.2.9 needs four corrections to produce only what the constraint allows, all measured on
``scripts/harness/structured_cases.py`` (profiles/grammar-backends-amd-epyc-2core):

- it reads special tokens as text (``<s>`` as the three characters), so its vocabulary is rebuilt with
  them empty, which it never allows;
- its JSON strings take raw control characters (0x00-0x1f but ``\\n`` ``\\r``), which JSON forbids; compact
  JSON has none anywhere else, so JSON grammars are compiled against a second vocabulary in which every token
  holding one is empty (never allowed): the fill leaves them out itself, nothing is ANDed afterwards;
- it accepts ED A0-BF, the UTF-8 of a surrogate (U+D800-DFFF), which is not valid UTF-8: after a token
  ending in a lone 0xED, tokens starting with A0-BF are removed;
- it compiles some JSON Schema keywords without enforcing them (``XGRAMMAR_UNENFORCED``): such a schema is
  refused, as llguidance refuses them, rather than constrained wrongly.

One difference is left: its regex ``.`` also matches a newline (Python's and Rust's do not).

The batched calls (``accept_batch``, ``fill_batch``) run once per step over every grammar row, on the
planner's critical path: they call xgrammar's tvm-ffi functions directly with each matcher's FFI handle,
cached at creation, instead of through its Python wrappers, whose per-row list building and result
conversion (~0.9 us an element for a tvm-ffi ``Array``) cost as much as the C++ work for 128 rows. The
calls release the GIL (tvm-ffi's default), so the planner's other threads run meanwhile.
"""

from __future__ import annotations

import json
import operator
import os
import re
from typing import Any

import numpy as np

from asyncbatch.sampling.grammar_libs import (
    JSON_OBJECT_SCHEMA,
    LARK_SYNTAX,
    Compiled,
    Matcher,
    pack_bits,
    special_token_ids,
)
from asyncbatch.sampling.token_bitmask import bitmask_words
from asyncbatch.structured_outputs import StructuredOutputsParams

MAX_SCHEMA_DEPTH = 64  # compile time grows ~cubically with nesting: 7 s at 256 (llguidance stops near 64)
# Keywords xgrammar 0.2.9 accepts but does not enforce. allOf counts with 2+ entries (one entry, pydantic's
# ``allOf: [{"$ref": ...}]``, is enforced), uniqueItems when true.
XGRAMMAR_UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
                       "dependentRequired", "dependentSchemas", "dependencies")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "propertyNames", "not", "if", "then", "else", "contains")


def scan_schema(schema: Any) -> tuple[list[str], int]:
    """(the unenforced keywords used anywhere in ``schema``'s subschemas, not in its data: ``enum``,
    ``const``, ``default``, property names; how deep its subschemas nest). Iterative: any depth."""
    found: set[str] = set()
    stack, deepest = [(schema, 1)], 0
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        deepest = max(deepest, depth)
        found.update(k for k in XGRAMMAR_UNENFORCED if k in node)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.add("allOf")
        if node.get("uniqueItems") is True:
            found.add("uniqueItems")
        children = [node[k] for k in _SUBSCHEMAS if isinstance(node.get(k), dict)]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children.extend(node[key].values())
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children.extend(node[key])
        stack.extend((child, depth + 1) for child in children)
    return sorted(found), deepest


class XGrammarMatcher(Matcher):
    __slots__ = ("_after_ed", "_done", "_h", "_lib")
    _tracked = ("_start", "_after_ed", "_done")

    def __init__(self, matcher: Any, compiled: Compiled, lib: XGrammarLib) -> None:
        super().__init__(matcher, compiled, lib.eos, lib.vocab_size)
        self._lib = lib
        self._h = lib.ffi_handle(matcher)  # what the batched calls take (``XGrammarLib.accept_batch``)
        self._after_ed = False  # the text ends with a lone 0xED, the lead byte of a 3-byte UTF-8 sequence
        self._done = False  # EOS accepted: xgrammar's matcher is terminated (tracked here: asked every step)

    def _accept(self, token_id: int) -> bool:
        if not self._m.accept_token(token_id):
            return False
        self.accepted(token_id)
        return True

    def accepted(self, token_id: int) -> None:
        """The library took ``token_id`` (here or in ``XGrammarLib.accept_batch``): update what we track."""
        self._start = None
        self._after_ed = token_id in self._lib.ends_with_ed
        self._done = token_id == self._lib.eos

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._after_ed:
            np.bitwise_and(bitmask[row], self._lib.no_surrogate_tail, out=bitmask[row])

    def is_terminated(self) -> bool:
        return self._done


class XGrammarLib:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int) -> None:
        import xgrammar as xgr

        self._xgr, self.eos, self.vocab_size = xgr, eos, vocab_size
        detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        # Special tokens (EOS too: a stop token, never text) as empty strings, which xgrammar never
        # allows; ids past the tokenizer's own vocabulary are empty already.
        special = special_token_ids(tokenizer) | {eos}
        encoded = [""] * vocab_size
        for token, idx in tokenizer.get_vocab().items():
            if 0 <= idx < vocab_size and idx not in special:
                encoded[idx] = token

        def compiler_for(tokens: list[str]) -> tuple[Any, Any]:
            """A vocabulary of ``tokens`` (the tokenizer's type, EOS the stop token) and a compiler over it.
            ``grammar.GrammarCompiler`` keeps a bounded cache; xgrammar's own is unbounded by default."""
            info = xgr.TokenizerInfo(tokens, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=[eos],
                                     add_prefix_space=detected.add_prefix_space)
            return info, xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)

        self.info, self._compiler = compiler_for(encoded)
        decoded = self.info.decoded_vocab
        control = re.compile(rb"[\x00-\x1f]")
        holds_control = [control.search(t) is not None for t in decoded]
        # JSON grammars compile against a vocabulary without the tokens that hold a control character (empty,
        # so never allowed): the same masks as ANDing every JSON row with a filter of those tokens after each
        # fill (checked over 2,457 states of random walks), a sixth less fill time (0.20 -> 0.165 ms a step for
        # 128 JSON rows at vocab 49k, on the planner's chain; profiles/structured-output-sim-intel-xeon-2core).
        _, self._json_compiler = compiler_for(["" if bad else token for token, bad in zip(encoded, holds_control)])
        self.ends_with_ed = frozenset(i for i, t in enumerate(decoded) if t.endswith(b"\xed"))
        self.no_surrogate_tail = pack_bits(np.array([not (t and 0xA0 <= t[0] <= 0xBF) for t in decoded],
                                                    dtype=bool))
        # One call fills many rows on xgrammar's threads: per-row calls cost ~100 us each in their Python
        # wrapper at vocab 49k, the batch ~3-13 us a row (profiles/grammar-backends-amd-epyc-2core).
        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        # xgrammar 0.2.9's FFI entry points behind ``BatchGrammarMatcher``'s two batch methods (see the module
        # docstring for why they are called directly): (handles, tokens, debug) and (handles, bitmask, rows,
        # debug).
        # They are private: any other xgrammar than the pinned one gets the public wrappers instead (slower,
        # same results), so a version bump costs speed, not correctness.
        try:
            from xgrammar.base import _core  # private-name: xgrammar's FFI module, pinned

            self._accept_ffi = _core.BatchGrammarMatcher.batch_accept_token  # private-name: xgrammar's, pinned
            self._fill_ffi = self._batch._handle.batch_fill_next_token_bitmask  # private-name: xgrammar's, pinned
            self.ffi_handle = operator.attrgetter("_handle")
        except (ImportError, AttributeError):
            public = xgr.BatchGrammarMatcher
            self._accept_ffi = lambda matchers, tokens, _debug: public.batch_accept_token(matchers, tokens)
            self._fill_ffi = lambda matchers, bitmask, rows, _debug: self._batch.batch_fill_next_token_bitmask(
                matchers, bitmask, rows)
            self.ffi_handle = lambda matcher: matcher

    def accept_batch(self, matchers: list[XGrammarMatcher], tokens: list[int]) -> list[bool]:
        """``[m.accept(t) for m, t in zip(matchers, tokens)]`` with the library's part in one call."""
        if not matchers:
            return []
        if min(tokens) < 0 or max(tokens) >= self.vocab_size or any(m._done for m in matchers):
            return self._accept_some(matchers, tokens)
        result = self._accept_ffi([m._h for m in matchers], tokens, False)  # [R] 0/1, a tvm-ffi Array
        if 0 in result:  # one FFI call; converting the array would cost ~0.9 us a row
            ok = [bool(a) for a in result]
        else:
            ok = [True] * len(matchers)
        ed, eos = self.ends_with_ed, self.eos
        for m, t, good in zip(matchers, tokens, ok):
            if good:  # ``XGrammarMatcher.accepted``, inlined: it runs for every grammar row of every step
                m._start = None
                m._after_ed = t in ed
                m._done = t == eos
        return ok

    def _accept_some(self, matchers: list[XGrammarMatcher], tokens: list[int]) -> list[bool]:
        """``accept_batch`` when some token is out of range or some matcher has ended (those refuse)."""
        ok = [0 <= t < self.vocab_size and not m.is_terminated() for m, t in zip(matchers, tokens)]
        live = [i for i, good in enumerate(ok) if good]
        if live:
            accepted = list(self._accept_ffi([matchers[i]._h for i in live], [tokens[i] for i in live], False))
            for i, good in zip(live, accepted):
                ok[i] = bool(good)
                if good:
                    matchers[i].accepted(tokens[i])
        return ok

    def fill_batch(self, matchers: list[XGrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        """``matchers[i].fill_bitmask(bitmask, rows[i])`` for every ``i``, the library's part in one call."""
        handles, live_rows, after_ed = [], [], []
        for m, row in zip(matchers, rows):
            if m._start is not None or m._done:
                m.fill_without_library(bitmask, row)
                continue
            handles.append(m._h)
            live_rows.append(row)
            if m._after_ed:
                after_ed.append(row)
        if not handles:
            return
        self._fill_ffi(handles, bitmask, live_rows, False)
        if after_ed:
            bitmask[after_ed] &= self.no_surrogate_tail

    def _grammar(self, params: StructuredOutputsParams) -> Any:
        kind, c = params.kind, self._compiler
        if kind in ("json", "json_object"):
            schema = params.schema_text if kind == "json" else JSON_OBJECT_SCHEMA
            unenforced, depth = scan_schema(json.loads(schema))
            if unenforced:
                raise ValueError(f"uses {', '.join(unenforced)}, which the xgrammar backend does not enforce")
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"nests subschemas {depth} deep, more than {MAX_SCHEMA_DEPTH}")
            return self._json_compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice)
            return c.compile_grammar(f"root ::= {alternatives}")
        text = params.grammar or ""
        if not text.strip():
            raise ValueError("the grammar is empty")
        return c.compile_lark(text) if LARK_SYNTAX.search(text) else c.compile_grammar(text)

    def compile(self, params: StructuredOutputsParams) -> Compiled:
        grammar = self._grammar(params)
        start = np.zeros((1, bitmask_words(self.vocab_size)), dtype=np.int32)
        probe = Compiled(grammar, start[0])
        XGrammarMatcher(self._xgr.GrammarMatcher(grammar), probe, self)._fill(start, 0)
        start.flags.writeable = False
        return Compiled(grammar, start[0])

    def matcher(self, compiled: Compiled) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled.grammar), compiled, self)
