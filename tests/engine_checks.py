"""Helpers that compare runs and read the timeline, shared by the engine tests."""

from __future__ import annotations

import time

from asyncbatch.profiling.timeline import steady_decode_window, summarize


def assert_idle_and_clean(llm) -> None:
    """After every request ended: accounting holds and every KV block is free."""
    llm.check_integrity()
    assert llm.num_free_blocks == llm.num_usable_blocks


def wait_all_ended(llm, timeout: float = 30.0) -> None:
    """Until the engine (``LLM`` or ``AsyncLLM``) has no unfinished request, every step applied: a request that
    was not aborted has then run to its end, so its tokens count in ``stats()["output_tokens"]``."""
    deadline = time.monotonic() + timeout
    while llm.num_requests()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.num_requests()[0] == 0, f"{llm.num_requests()[0]} requests still unfinished"
    inner = getattr(llm, "llm", llm)  # AsyncLLM's blocking engine
    assert inner.wait_settled(timeout)


def window_stats(llm, min_decode: int) -> dict:
    window = steady_decode_window(llm.timeline.window(), min_decode)
    assert len(window) >= 20, f"steady decode window too short ({len(window)} steps)"
    return summarize(window)
