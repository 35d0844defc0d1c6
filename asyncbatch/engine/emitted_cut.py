"""Where a verify step's tokens end for each row: the first position that finishes the request, as arrays.

A speculative step emits ``emitted[i]`` tokens for row ``i`` (``[F, W]``, ``W = 1 + depth``). Applied one
position at a time, the plain rules (``step_apply.finish_code``) end a request at the first token that is
EOS (unless ``ignore_eos``), one of its stop ids, or its ``max_tokens``-th output, and the tokens after it are
dropped. ``first_finish`` computes the same cut for every row at once:

    position          0     1     2     3     4
    emitted (3)      [t0]  [t1]  [t2]   .     .
    codes             -    EOS   LEN    .     .     (a code per position, highest rule first; past emitted: none)
    cut               kept = 2 (t0, t1), code EOS

Stop ids are the one rule that needs the request's parameters: the caller passes ``stop_hits`` ``[F, W]``
(computed in Python for the few rows that have stop ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncbatch.engine.messages import Finish

_NONE, _EOS, _STOP_TOKEN, _LENGTH = int(Finish.NONE), int(Finish.EOS), int(Finish.STOP_TOKEN), int(Finish.LENGTH)


@dataclass(slots=True)
class Cut:
    """Per row: how many of its emitted tokens are kept, and the ``Finish`` code of the last kept one."""

    kept: np.ndarray  # [F] int64, 1 .. emitted
    codes: np.ndarray  # [F] int8 Finish (NONE: the request goes on)


def first_finish(tokens: np.ndarray, emitted: np.ndarray, num_outputs: np.ndarray, max_tokens: np.ndarray,
                 ignore_eos: np.ndarray, eos_token_id: int | None, stop_hits: np.ndarray | None = None) -> Cut:
    """The cut of rows whose tokens are ``tokens`` ``[F, W]`` (the first ``emitted[i]`` of row ``i`` count),
    whose requests had ``num_outputs`` outputs before them and may have ``max_tokens`` (``[F]`` each).
    ``stop_hits`` ``[F, W]`` bool: the token is one of the row's stop ids (None: no row has any)."""
    f, w = tokens.shape
    position = np.arange(w)  # [W]
    # LENGTH where the output count reaches max_tokens, then stop ids, then EOS: later writes win, as in
    # ``finish_code`` the earlier rules do.
    codes = ((num_outputs[:, None] + position + 1) >= max_tokens[:, None]).view(np.int8) * np.int8(_LENGTH)  # [F, W]
    if stop_hits is not None:
        codes[stop_hits] = _STOP_TOKEN
    if eos_token_id is not None:
        codes[(tokens == eos_token_id) & ~ignore_eos[:, None]] = _EOS
    codes[position >= emitted[:, None]] = _NONE  # not emitted
    ends = codes != _NONE  # [F, W]
    first = ends.argmax(axis=1)  # [F] the first finishing position (0 where none: its code is NONE then)
    hit = ends[np.arange(f), first]  # [F]
    return Cut(np.where(hit, first + 1, emitted), codes[np.arange(f), first])
