"""Shared fixtures: engines are closed after each test, and no engine thread outlives it."""

from __future__ import annotations

import os
import shutil
import threading

# Without a GPU, the Triton kernels' tests run in Triton's interpreter, which must be chosen before
# anything imports triton (transformers does, through torch._dynamo). nvidia-smi stands in for a CUDA
# check here because importing torch first is what must not happen.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
