"""The token ids of ``token_only`` requests, kept as the steps' arrays until someone reads them as lists.

A ``token_only`` request (not streamed, no stop strings, no logprobs:
``RequestHandle``) needs nothing per step but its new id appended, and nobody
reads its ids before it ends. Appending them one Python call per row and step
is the frontend's token rate (~0.5-1 us a row on a 2-core VM: a 1,024-row step
took about as long as a 1 ms step). So after a request's first token (which
takes the per-row path and ``track``s it) its rows are cut out of each step's
arrays with a few array operations (``log``) and kept here, one pair of arrays
per step:

    output thread  [step N: log(rows of tracked requests) | the other rows, one by one]
                   [step N+k: a tracked request ends: flush(its seq) before its last token]
                   [every ``max_steps`` steps: flush() every tracked request's ids]

Invariant: a tracked request's ``token_ids`` followed by its logged ids, in log
order, are its ids so far; ``flush`` moves logged ids to the lists (its text
ids too, hidden ids left out), in that order, and the output processor flushes
a request before anything reads or appends to its lists. Only the output
thread uses this object. Tracking is by seq, in a flag array over the seqs
from the oldest tracked one (``_base``) to the newest, so a long-running
server's memory grows with the span of the requests live at once, not with
every request it has served.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from asyncbatch.frontend.request_handle import RequestHandle

_MIN_FLAGS = 1024


class TokenLog:
    """Logged ids of tracked ``token_only`` requests (see the module doc); ``handles`` are the live handles by
    seq (the output processor's), ``hidden`` the ids left out of text (EOS); the output processor flushes
    everything once ``num_steps`` reaches ``max_steps``."""

    def __init__(self, handles: dict[int, RequestHandle], hidden: frozenset[int], max_steps: int = 16) -> None:
        self._handles = handles
        self._hidden = hidden
        self._hidden_ids = np.fromiter(hidden, dtype=np.int64, count=len(hidden))
        self.max_steps = max_steps
        self._flags = np.zeros(_MIN_FLAGS, dtype=bool)  # [capacity] tracked, by seq - _base
        self._base = 0
        self._num_tracked = 0
        self._seqs: list[np.ndarray] = []  # chunks of logged rows, in log order (a chunk a step, until a flush)
        self._tokens: list[np.ndarray] = []
        self._steps = 0  # steps logged since the last full flush

    @property
    def num_steps(self) -> int:
        """Steps logged since the last full ``flush``."""
        return self._steps

    def track(self, seq: int) -> None:
        """Log ``seq``'s later rows (its handle is live and ``token_only``, and its lists are up to date)."""
        i = seq - self._base
        if i < 0 or i >= len(self._flags):
            i = self._rebase(seq)
        if not self._flags[i]:
            self._flags[i] = True
            self._num_tracked += 1

    def untrack(self, seq: int) -> None:
        """Stop logging ``seq`` (flushed first by the caller where its lists are still read)."""
        i = seq - self._base
        if 0 <= i < len(self._flags) and self._flags[i]:
            self._flags[i] = False
            self._num_tracked -= 1

    def log(self, seqs: np.ndarray, tokens: np.ndarray, finish: np.ndarray) -> np.ndarray | None:
        """Take a step's rows (``[R]`` seqs, tokens and finish codes) of tracked requests that go on (code 0) into
        the log; returns the mask (``[R]`` bool) of the rows left to the caller, or None when it took none."""
        if not self._num_tracked or not len(seqs):
            return None
        flags, i = self._flags, seqs - self._base  # [R]
        if int(i.min()) >= 0 and int(i.max()) < len(flags):
            taken = flags[i]
        else:
            inside = (i >= 0) & (i < len(flags))
            taken = flags[np.where(inside, i, 0)] & inside
        taken &= finish == 0
        if not taken.any():
            return None
        self._seqs.append(seqs[taken])
        self._tokens.append(tokens[taken])
        self._steps += 1
        return ~taken

    def flush(self, only: Collection[int] | None = None) -> None:
        """Append the logged ids of ``only`` (seqs; None: every request, and the log is emptied) to their
        handles' lists, in order; ``only``'s entries leave the log. Entries of requests no longer live are
        dropped."""
        if not self._seqs:
            return
        seqs = self._seqs[0] if len(self._seqs) == 1 else np.concatenate(self._seqs)  # [L] in log order
        tokens = self._tokens[0] if len(self._tokens) == 1 else np.concatenate(self._tokens)  # [L]
        if only is None:
            self._seqs.clear()
            self._tokens.clear()
            self._steps = 0
            self._append(seqs, tokens)
            return
        chosen = np.isin(seqs, np.fromiter(only, dtype=np.int64, count=len(only)))  # [L]
        if not chosen.any():
            return
        kept = ~chosen
        # The rest stays logged as one chunk (its order is the log's; none when nothing is left); ``num_steps``
        # counts steps, not chunks.
        self._seqs[:], self._tokens[:] = ([seqs[kept]], [tokens[kept]]) if kept.any() else ([], [])
        self._append(seqs[chosen], tokens[chosen])

    def _append(self, seqs: np.ndarray, tokens: np.ndarray) -> None:
        """Move logged entries (``[L]`` seqs and ids, in log order) to their handles' lists."""
        if not len(seqs):
            return
        order = np.argsort(seqs, kind="stable")  # [L] by request, each one's ids in log order
        seqs, tokens = seqs[order], tokens[order]
        starts = np.flatnonzero(np.diff(seqs, prepend=seqs[0] - 1))  # [G] first entry of each request
        ends = np.append(starts[1:], len(seqs))  # [G]
        hidden = None
        if len(self._hidden_ids):
            is_hidden = np.isin(tokens, self._hidden_ids)  # [L]
            if is_hidden.any():
                hidden = np.add.reduceat(is_hidden, starts).tolist()  # [G] hidden ids per request
        ids, handles = tokens.tolist(), self._handles
        for k, (seq, lo, hi) in enumerate(zip(seqs[starts].tolist(), starts.tolist(), ends.tolist())):
            handle = handles.get(seq)
            if handle is None or handle.done.is_set():
                continue
            run = ids[lo:hi]
            handle.token_ids.extend(run)
            text_ids = handle.text_ids
            if text_ids is not None:
                text_ids.extend(run if hidden is None or not hidden[k] else
                                [t for t in run if t not in self._hidden])

    def _rebase(self, seq: int) -> int:
        """Make room for ``seq`` in the flags: the array starts at the oldest tracked seq (or ``seq``) and holds at
        least twice the tracked span (so that rebases stay rare as new seqs arrive), shrinking once long-lived
        requests have ended; returns ``seq``'s index."""
        tracked = np.flatnonzero(self._flags)
        low = min(seq, self._base + int(tracked[0])) if len(tracked) else seq
        high = max(seq, self._base + int(tracked[-1])) if len(tracked) else seq
        size = _MIN_FLAGS
        while size <= 2 * (high - low):
            size *= 2
        moved = np.zeros(size, dtype=bool)
        moved[tracked + self._base - low] = True
        self._flags, self._base = moved, low
        return seq - low
