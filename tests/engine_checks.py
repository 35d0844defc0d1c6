"""Helpers that compare runs and read the timeline, shared by the engine tests."""

from __future__ import annotations

from asyncbatch.timeline import StepRecord, summarize


def assert_idle_and_clean(llm) -> None:
    """After every request ended: accounting holds and every KV block is free."""
    llm.check_integrity()
    assert llm.num_free_blocks == llm.num_usable_blocks


def decode_window(records: list[StepRecord], min_decode: int) -> list[StepRecord]:
    """The contiguous steady-state decode steps: after the last prefill, while >= min_decode rows run."""
    last_prefill = max((i for i, r in enumerate(records) if r.num_prefill), default=-1)
    window = []
    for record in records[last_prefill + 1:]:
        if record.num_decode < min_decode:
            break
        window.append(record)
    return window


def window_stats(llm, min_decode: int) -> dict:
    window = decode_window(llm.timeline.window(), min_decode)
    assert len(window) >= 20, f"steady decode window too short ({len(window)} steps)"
    return summarize(window)
