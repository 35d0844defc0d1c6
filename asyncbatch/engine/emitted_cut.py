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
    ``stop_hits`` ``[F, W]`` bool: the token is one of the row's stop ids (None: no row has any).

    A handful of array operations when no token is EOS or a stop id (the common step): ``max_tokens`` cuts
    at a position known per row, so only EOS and stop ids need a ``[F, W]`` search."""
    room = max_tokens - num_outputs  # [F] outputs the request may still take (>= 1 while it holds its row)
    kept = np.minimum(emitted, room)  # [F]
    codes = (room <= emitted).view(np.int8) * np.int8(_LENGTH)  # [F] LENGTH where max_tokens cuts
    ends = stop_hits
    eos = None
    if eos_token_id is not None:
        eos = tokens == eos_token_id  # [F, W]
        if eos.any():
            eos &= ~ignore_eos[:, None]
            ends = eos if ends is None else eos | ends
        else:
            eos = None
    if ends is None:
        return Cut(kept, codes)
    ends = ends & (np.arange(tokens.shape[1]) < kept[:, None])  # [F, W] within the tokens max_tokens keeps
    hit = ends.any(axis=1).nonzero()[0]  # [H] rows an EOS or a stop id ends first (at max_tokens' cut too)
    if len(hit):
        first = ends[hit].argmax(axis=1)  # [H]
        kept[hit] = first + 1
        # EOS outranks a stop id at the same token, as in ``finish_code``.
        codes[hit] = _STOP_TOKEN if eos is None else np.where(eos[hit, first], _EOS, _STOP_TOKEN)
    return Cut(kept, codes)
