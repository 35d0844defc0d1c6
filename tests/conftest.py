"""Shared fixtures: engines are closed after each test, and no engine thread outlives it."""

from __future__ import annotations

import multiprocessing
import os
import threading

import torch

# Without a GPU, the Triton kernels' tests run in Triton's interpreter, which must be chosen before
# anything imports triton (transformers does, through torch._dynamo; importing torch and asking it
# about CUDA does not). A caller's explicit TRITON_INTERPRET wins (gpu_check.sh sets it to 0).
if not torch.cuda.is_available():
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
    cores = [p.pid for p in multiprocessing.active_children() if p.name == "asyncbatch-core"]
    assert not cores, f"engine core processes left alive: {cores}"
