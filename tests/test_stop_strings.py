"""StopStringMatcher: split-independent stop semantics and streaming safety."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncbatch.frontend.stop_strings import StopFeed, StopStringMatcher


def reference(text: str, stops: list[str], include: bool, after: int = 0) -> tuple[str, str | None]:
    """The documented rule, stated naively: grow the text one character at a
    time; the first end position where some stop ends wins, longest stop on a tie.
    ``after``: stops that end within the first ``after`` characters (the text of the
    tokens before ``min_tokens`` was reached) do not count; one may begin there."""
    for end in range(after + 1, len(text) + 1):
        ending_here = [s for s in stops if text.endswith(s, 0, end)]
        if ending_here:
            stop = max(ending_here, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def run(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, list[StopFeed]]:
    feeds = [matcher.feed(d) for d in deltas]
    out = "".join(f.emit for f in feeds)
    if not any(f.stopped for f in feeds):
        out += matcher.flush()
    return out, feeds


ALPHABET = "ab\né🎉"
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_sets = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4)
cut_lists = st.lists(st.integers(min_value=0, max_value=60), max_size=12)


@settings(max_examples=400, deadline=None)
@given(text=texts, stops=stop_sets, cuts=cut_lists, include=st.booleans())
def test_output_matches_reference_for_any_split(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    deltas = split(text, cuts)
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    out, feeds = run(matcher, deltas)
    expected, matched = reference(text, stops, include)
    assert out == expected
    stopped_at = [i for i, f in enumerate(feeds) if f.stopped]
    if matched is None:
        assert not stopped_at
        assert all(f.matched is None for f in feeds)
    else:
        first = stopped_at[0]
        assert feeds[first].matched == matched
        # The stop is reported by the delta that completes it, not earlier or later.
        consumed = sum(len(d) for d in deltas[: first + 1])
        end = len(expected) + (0 if include else len(matched))
        assert consumed - len(deltas[first]) < end <= consumed
        # Later feeds (a token computed one step late) emit nothing.
        assert all(f.emit == "" and f.stopped and f.matched == matched for f in feeds[first + 1 :])
        assert matcher.flush() == ""


@settings(max_examples=400, deadline=None)
@given(text=texts, stops=stop_sets, cuts=cut_lists, include=st.booleans(), unmatched=st.integers(0, 12))
def test_text_short_of_min_tokens_cannot_stop_the_output(
    text: str, stops: list[str], cuts: list[int], include: bool, unmatched: int
) -> None:
    """vLLM's ``min_tokens`` rule: the first deltas (the tokens up to ``min_tokens``) are fed with ``match=False``;
    a stop string ending in them does not count, one that begins in them and ends later does."""
    deltas = split(text, cuts)
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    feeds = [matcher.feed(d, match=i >= unmatched) for i, d in enumerate(deltas)]
    out = "".join(f.emit for f in feeds)
    if not any(f.stopped for f in feeds):
        out += matcher.flush()
    assert (out, next((f.matched for f in feeds if f.stopped), None)) == reference(
        text, stops, include, after=sum(len(d) for d in deltas[:unmatched]))


def test_min_tokens_examples() -> None:
    early = StopStringMatcher(["."])
    assert early.feed(" Paris.", match=False) == StopFeed(" Paris.", False, None)  # too early: goes on
    assert early.feed(" It is.") == StopFeed(" It is", True, ".")
    straddling = StopStringMatcher(["ab"])
    assert straddling.feed("xa", match=False) == StopFeed("x", False, None)  # "a" may start "ab": held
    assert straddling.feed("b!") == StopFeed("", True, "ab")  # begins in the early text, ends after it


@settings(max_examples=300, deadline=None)
@given(text=texts, stops=stop_sets, cuts=cut_lists)
def test_never_emits_a_possible_stop_start(text: str, stops: list[str], cuts: list[int]) -> None:
    """After each feed, the held text is exactly the longest suffix of the text so
    far that is a proper prefix of a stop string: nothing unsafe is emitted, and
    nothing safe is delayed."""
    matcher = StopStringMatcher(stops)
    seen = emitted = ""
    for delta in split(text, cuts):
        feed = matcher.feed(delta)
        if feed.stopped:
            break
        seen += delta
        emitted += feed.emit
        assert seen.startswith(emitted)
        held = seen[len(emitted) :]
        proper_prefixes = {s[:n] for s in stops for n in range(1, len(s))}
        assert held == "" or held in proper_prefixes
        assert not any(seen[j:] in proper_prefixes for j in range(len(emitted)))


@settings(max_examples=100, deadline=None)
@given(text=texts, stops=stop_sets, cuts=cut_lists)
def test_include_mode_holds_nothing_back(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopStringMatcher(stops, include_stop_str_in_output=True)
    seen = emitted = ""
    for delta in split(text, cuts):
        feed = matcher.feed(delta)
        seen += delta
        emitted += feed.emit
        if feed.stopped:
            assert emitted.endswith(feed.matched)
            break
        assert emitted == seen


def test_stop_spanning_deltas() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("Hello\n") == StopFeed("Hello", False, None)
    assert matcher.feed("\nWorld") == StopFeed("", True, "\n\n")
    assert matcher.stopped


def test_held_prefix_released_when_disambiguated() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == StopFeed("go ", False, None)
    assert matcher.feed("O") == StopFeed("", False, None)
    assert matcher.feed("RM!") == StopFeed("STORM!", False, None)
    assert matcher.feed("ST") == StopFeed("", False, None)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_earliest_end_wins_over_list_order() -> None:
    # vLLM would take "cd" (first in the list); the earliest end is "b"'s.
    assert StopStringMatcher(["cd", "b"]).feed("abcd") == StopFeed("a", True, "b")
    assert StopStringMatcher(["cd", "b"], True).feed("abcd") == StopFeed("ab", True, "b")


def test_longest_stop_wins_a_tie() -> None:
    for stops in (["b", "ab"], ["ab", "b"]):
        assert StopStringMatcher(stops).feed("xab") == StopFeed("x", True, "ab")
        assert StopStringMatcher(stops, True).feed("xab") == StopFeed("xab", True, "ab")


def test_multibyte_and_emoji_stops() -> None:
    matcher = StopStringMatcher(["🎉日"])
    assert matcher.feed("é🎉") == StopFeed("é", False, None)
    assert matcher.feed("日本") == StopFeed("", True, "🎉日")


def test_no_stops_is_pass_through() -> None:
    matcher = StopStringMatcher([])
    delta = "anything\n\n"
    feed = matcher.feed(delta)
    assert feed.emit is delta and not feed.stopped and feed.matched is None
    assert matcher.flush() == ""


def test_single_string_and_duplicates() -> None:
    assert StopStringMatcher("x").feed("abxc") == StopFeed("ab", True, "x")
    assert StopStringMatcher(["x", "x"]).feed("abxc") == StopFeed("ab", True, "x")


def test_empty_stop_string_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])


def test_empty_delta_is_harmless() -> None:
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("a") == StopFeed("", False, None)
    assert matcher.feed("") == StopFeed("", False, None)
    assert matcher.feed("b") == StopFeed("", True, "ab")
