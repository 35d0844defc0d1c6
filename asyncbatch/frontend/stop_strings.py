"""Stop strings over streamed text: where to cut, and what is safe to emit now.

Which stop wins: the occurrence with the smallest end position in the text, the
longest stop string on a tie; the output ends right before it (or after it, with
``include_stop_str_in_output``). The answer depends only on the text, never on how
it was split into deltas. Without ``include_stop_str_in_output``, the longest suffix
of the unemitted text that is a proper prefix of a stop string is held back until
later text rules it in or out, so emitted text is never retracted. Each feed
searches only the last ``max_len - 1`` characters plus the delta.

Specification: docs/detokenizer.md ("Stop strings")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopFeed(NamedTuple):
    """Result of feeding one text delta.

    ``emit``: text now safe to stream (possibly ""). ``stopped``: a stop string
    was completed; ``emit`` then ends right before it (or after it, when it is
    included) and the request is over. ``matched``: that stop string, else None.
    """

    emit: str
    stopped: bool
    matched: str | None


class StopStringMatcher:
    """Streams one request's text and finds its first stop string.

    Invariants:
    - The concatenation of every ``emit`` (plus :meth:`flush` when no stop
      matched) is the reference output defined in the module docstring.
    - Without ``include_stop_str_in_output``, no emitted text is the start of an
      unfinished stop string: emitted text is never retracted.
    - After a stop (or, with stop strings, a flush), further feeds emit nothing
      and report the same result, so a token computed one step late is dropped.

    With no stop strings, :meth:`feed` passes text through at near-zero cost.
    """

    __slots__ = (
        "_done",
        "_held",
        "_include",
        "_keep",
        "_matched",
        "_prefixes_by_last_char",
        "_stops",
        "_window",
    )

    def __init__(self, stops: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        if isinstance(stops, str):
            stops = (stops,)
        unique = tuple(dict.fromkeys(stops))
        if any(not isinstance(s, str) for s in unique):
            raise TypeError("stop strings must be str")
        if "" in unique:
            raise ValueError("stop strings must not be empty")
        # Longest first: when two stops end at the same position, the longer wins.
        self._stops = tuple(sorted(unique, key=len, reverse=True))
        self._include = include_stop_str_in_output
        self._keep = max((len(s) for s in unique), default=1) - 1
        self._prefixes_by_last_char = _proper_prefixes_by_last_char(unique)
        # Last `keep` characters of the text; its last `held` ones are not emitted yet.
        self._window = ""
        self._held = 0
        self._done = False
        self._matched: str | None = None

    @property
    def active(self) -> bool:
        """False when there is nothing to match: ``feed`` would return its input unchanged."""
        return bool(self._stops)

    @property
    def stopped(self) -> bool:
        return self._matched is not None

    def feed(self, delta: str, match: bool = True) -> StopFeed:
        """Add the next piece of text; return what may be emitted now. ``match=False``: the text cannot end the
        output (the request is still short of ``min_tokens``: vLLM's rule); text that may start a stop string
        is held back all the same, and a stop string that ends in a later piece may begin in this one."""
        if not self._stops:
            return StopFeed(delta, False, None)
        if self._done:
            return StopFeed("", self._matched is not None, self._matched)
        if not delta:
            return StopFeed("", False, None)
        buf = self._window + delta
        start = len(self._window) - self._held  # first unemitted character of buf
        matched, end = self._first_stop(buf, len(self._window)) if match else (None, 0)
        if matched is not None:
            self._done = True
            self._matched = matched
            cut = end if self._include else end - len(matched)
            self._window = ""
            self._held = 0
            return StopFeed(buf[start:cut], True, matched)
        hold = 0 if self._include else self._held_suffix(buf)
        self._window = buf[max(len(buf) - self._keep, 0) :] if self._keep else ""
        self._held = hold
        return StopFeed(buf[start : len(buf) - hold], False, None)

    def flush(self) -> str:
        """End of the request for another reason (EOS, length): release held text."""
        if self._done:
            return ""
        self._done = True
        held = self._window[len(self._window) - self._held :] if self._held else ""
        self._window = ""
        self._held = 0
        return held

    def _first_stop(self, buf: str, old: int) -> tuple[str | None, int]:
        """The occurrence in ``buf`` that ends in its new text (past its first ``old`` characters, the window)
        with the smallest end, longest stop on ties. Only text fed with ``match=False`` can hold a whole stop
        string in the window; it does not count."""
        best: str | None = None
        best_end = len(buf) + 1
        for stop in self._stops:  # longest first, so `<` keeps the longest on a tie
            at = buf.find(stop, max(old + 1 - len(stop), 0))
            if at >= 0 and at + len(stop) < best_end:
                best, best_end = stop, at + len(stop)
        return best, best_end

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        for prefix in self._prefixes_by_last_char.get(buf[-1], ()):
            if buf.endswith(prefix):
                return len(prefix)
        return 0


def _proper_prefixes_by_last_char(stops: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Non-empty proper prefixes of ``stops`` grouped by their last character,
    longest first, so the hold-back check only tries prefixes that can match."""
    table: dict[str, set[str]] = {}
    for stop in stops:
        for n in range(1, len(stop)):
            prefix = stop[:n]
            table.setdefault(prefix[-1], set()).add(prefix)
    return {c: tuple(sorted(ps, key=len, reverse=True)) for c, ps in table.items()}
