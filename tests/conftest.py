"""Shared fixtures: engines are closed after each test, and no engine thread outlives it."""

from __future__ import annotations

import threading

import pytest

from asyncbatch import LLM


@pytest.fixture
def make_llm():
    """Factory for engines that are closed when the test ends."""
    engines: list[LLM] = []

    def make(model=None, **kwargs) -> LLM:
        llm = LLM(model, **kwargs)
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        llm.close()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("asyncbatch-")]
    assert not leftover, f"engine threads left alive: {leftover}"
