"""``allowed_token_ids`` and ``bad_words`` as token masks: per request a ``TokenConstraint`` that the engine core's
grammar state (``engine.structured_state``) fills into the request's bitmask rows like a grammar's.

Both follow vLLM's ``SamplingParams`` fields. ``allowed_token_ids``: only those ids may be sampled, the same set
at every position. ``bad_words``: each word is tokenized as it stands (leading spaces dropped) and after a space,
the second form kept where it is another token sequence of the same length (vLLM's rule: a word at the start of
the text and inside it); a phrase's last token is forbidden wherever the request's output so far (not its
prompt) ends with the phrase's other tokens, so a one-token word is forbidden everywhere.

Why masks, not logit biases: a phrase's ban depends on the newest output token, which under overlap the host
learns only after the next step was launched. The grammar state already fills each mask once the step before it
was applied (the forward of the next step runs meanwhile, only its sampling waits), walks a verify step's drafts
with ``snapshot``/``rollback``, and the ``sim`` device picks inside masks: a constraint rides on all of it. A
request with a grammar too gets the grammar's mask ANDed with its constraint's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def bad_words_token_ids(tokenizer: Any, words: Sequence[str], vocab_size: int) -> list[list[int]]:
    """The token id phrases of ``words`` (``SamplingParams.bad_words``) under ``tokenizer``: per word its own
    tokens, and those of the word after a space where that is another sequence of the same length. A word
    with no tokens, or with an id outside ``[0, vocab_size)``, is a ``ValueError`` naming it."""
    phrases: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"SamplingParams.bad_words entry {word!r} has no tokens")
        phrases.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            phrases.append(spaced)
    bad = [t for phrase in phrases for t in phrase if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.bad_words token ids must be in [0, {vocab_size - 1}], got {bad[:5]}")
    return phrases


class TokenConstraint:
    """One request's ``allowed_token_ids`` and ``bad_words`` (as token id phrases), and its outputs so far.

    The ``GrammarMatcher`` protocol's methods except ``fill_bitmask``: ``apply`` narrows a row the caller filled
    (all allowed, or a grammar's mask). ``accept`` refuses a token the mask would have forbidden (so a token that
    slipped past ends the request instead of being kept). Planner thread only."""

    def __init__(self, vocab_size: int, allowed: Sequence[int] | None = None,
                 phrases: Sequence[Sequence[int]] | None = None) -> None:
        self.allowed_row: np.ndarray | None = None  # [W] int32 bitmask row, or None: every token
        if allowed:
            ids = np.unique(np.asarray(allowed, dtype=np.int64))
            row = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)  # a bitmask row's bits (``token_bitmask``)
            row[ids] = True
            self.allowed_row = np.packbits(row.reshape(-1, 32), axis=1, bitorder="little").view(np.int32)[:, 0]
            self._allowed = frozenset(ids.tolist())
        phrases = [tuple(int(t) for t in p) for p in (phrases or ()) if len(p)]
        self.banned: tuple[int, ...] = tuple(sorted({p[0] for p in phrases if len(p) == 1}))  # everywhere
        # Longer phrases by their second-to-last token (what the newest output must be for them to apply):
        # (the tokens before that one, the token banned).
        self._by_last: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for p in phrases:
            if len(p) > 1:
                self._by_last.setdefault(p[-2], []).append((p[:-2], p[-1]))
        self.outputs: list[int] = []

    def banned_now(self) -> list[int]:
        """The tokens forbidden at the next position: one-token words, and the last token of every phrase whose
        other tokens the outputs end with."""
        out = self.outputs
        if not out or out[-1] not in self._by_last:
            return list(self.banned)
        banned = list(self.banned)
        n = len(out)
        for before, token in self._by_last[out[-1]]:
            k = len(before)
            if n - 1 >= k and tuple(out[n - 1 - k:n - 1]) == before:
                banned.append(token)
        return banned

    def allows(self, token_id: int) -> bool:
        if self.allowed_row is not None and token_id not in self._allowed:
            return False
        return token_id not in self.banned_now()

    def accept(self, token_id: int) -> bool:
        """Record an output; False, with nothing recorded, if the mask forbade it."""
        if not self.allows(token_id):
            return False
        self.outputs.append(token_id)
        return True

    def apply(self, bitmask: np.ndarray, row: int) -> None:
        """Narrow row ``row`` of an int32 bitmask to what this constraint allows next."""
        if self.allowed_row is not None:
            bitmask[row] &= self.allowed_row
        banned = self.banned_now()
        if banned:
            words = bitmask[row].view(np.uint32)  # a few ids: scalar updates beat numpy's ufunc.at (~20 us a row)
            limit = len(words) * 32
            for token in banned:
                if token < limit:
                    words[token >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (token & 31)))

    def snapshot(self) -> tuple:
        return (len(self.outputs),)

    def rollback(self, num_tokens: int, snapshot: tuple) -> None:
        del self.outputs[snapshot[0]:]


def allows_any(row: np.ndarray, vocab_size: int) -> bool:
    """Whether an int32 bitmask row allows any token below ``vocab_size`` (the bits past it name no logit)."""
    full, rest = divmod(vocab_size, 32)
    if row[:full].any():
        return True
    return bool(rest) and bool(int(row[full]) & ((1 << rest) - 1))


def constraint_of(params: Any, vocab_size: int) -> TokenConstraint | None:
    """The ``TokenConstraint`` of a request's ``SamplingParams``, or None where it has neither field."""
    phrases = params.bad_words_token_ids if params.bad_words else None
    if params.allowed_token_ids is None and not phrases:
        return None
    return TokenConstraint(vocab_size, params.allowed_token_ids, phrases)


def walk_drafts(constraint: TokenConstraint, drafts: Sequence[int], bitmask: np.ndarray, first_row: int, width: int,
                eos_token_id: int | None, narrow_only: bool, vocab_size: int) -> bool:
    """A verify step's rows past the first for a constrained request: row ``first_row + j`` (``0 < j < width``)
    narrowed to what the constraint allows after the first ``j`` drafts. ``narrow_only``: the rows hold a
    grammar's masks along the same drafts (``GrammarCompiler.fill_draft_masks``), which the constraint narrows;
    otherwise they start all allowed. The walk stops at a draft the row before forbids (the device's check stops
    there too), at EOS and past the drafts: the rows from there on allow nothing. The constraint ends where it
    began. Returns False if a position the walk reached allows no token below ``vocab_size`` (the constraints
    exclude each other there)."""
    before = constraint.snapshot()
    walked = 0
    reachable = True
    for j in range(1, width):
        row = first_row + j
        if j > len(drafts):
            break
        token = int(drafts[j - 1])
        word, bit = token >> 5, token & 31
        prev = bitmask[row - 1]
        if token < 0 or word >= len(prev) or not (int(prev[word]) >> bit) & 1 or token == eos_token_id:
            break
        if not constraint.accept(token):
            break
        walked += 1
        if not narrow_only:
            bitmask[row] = -1
        constraint.apply(bitmask, row)
        reachable = reachable and allows_any(bitmask[row], vocab_size)
    bitmask[first_row + walked + 1:first_row + width] = 0
    constraint.rollback(walked, before)
    return reachable
