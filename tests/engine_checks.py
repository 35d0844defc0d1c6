"""Helpers that compare runs and read the timeline, shared by the engine tests."""

from __future__ import annotations

from asyncbatch.profiling.timeline import steady_decode_window, summarize


def assert_idle_and_clean(llm) -> None:
    """After every request ended: accounting holds and every KV block is free."""
    llm.check_integrity()
    assert llm.num_free_blocks == llm.num_usable_blocks


def window_stats(llm, min_decode: int) -> dict:
    window = steady_decode_window(llm.timeline.window(), min_decode)
    assert len(window) >= 20, f"steady decode window too short ({len(window)} steps)"
    return summarize(window)
