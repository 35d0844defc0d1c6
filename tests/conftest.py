"""Shared fixtures: engines are closed after each test, and no engine thread outlives it.

Every engine a test builds on the CPU names its dtype: ``dtype="auto"`` picks
bfloat16 or float32 by the CPU's features, and a test whose tokens depended on
that choice would pass on one machine and fail on the next. Only tests marked
``auto_dtype`` (whose subject is the choice itself) may leave it to ``auto``;
``ASYNCBATCH_CPU_FLAGS=amx_bf16`` runs them on the bfloat16 side of it.
"""

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
from asyncbatch.config import EngineConfig

_allow_auto_dtype = False

# Under pytest-xdist the workers share the cores: each engine (and each worker's own torch work) gets its
# share of them instead of every engine spinning up a thread per core (``scripts/test.sh`` runs 2 workers).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS_PER_WORKER = max(1, (os.cpu_count() or 1) // _WORKERS)
if _WORKERS > 1:
    torch.set_num_threads(THREADS_PER_WORKER)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the item's fixtures (module-scoped engines included) are built."""
    global _allow_auto_dtype
    _allow_auto_dtype = item.get_closest_marker("auto_dtype") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, modules with tests marked slow go first, most slow tests first (so the long ones
    do not end up alone on one worker at the end). Whole modules move, in their own order: ``scripts/test.sh``
    hands out whole modules (``--dist loadscope --no-loadscope-reorder``), so a module's fixtures (the Ray
    cluster, shared engines and references) are built once, on one worker."""
    if _WORKERS > 1 or config.getoption("numprocesses", default=None):
        def module(item: pytest.Item) -> str:
            return item.nodeid.split("::", 1)[0]

        slow: dict[str, int] = {}
        for item in items:
            if item.get_closest_marker("slow") is not None:
                slow[module(item)] = slow.get(module(item), 0) + 1
        items.sort(key=lambda item: -slow.get(module(item), 0))


_post_init = EngineConfig.__post_init__


def _post_init_for_tests(self: EngineConfig) -> None:
    """The config's own validation, then: under xdist, the worker's share of the cores; on the CPU, a
    named dtype (the module docstring says why)."""
    _post_init(self)
    if _WORKERS > 1 and self.num_threads is None:
        self.num_threads = THREADS_PER_WORKER
    on_cpu = self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())
    if on_cpu and self.dtype == "auto" and not _allow_auto_dtype:
        raise AssertionError("a test engine on the CPU must name its dtype (dtype='float32' for claims about "
                             "the engine, 'bfloat16' for the bfloat16 path); dtype='auto' depends on the CPU. "
                             "Mark the test auto_dtype where the choice itself is its subject.")


EngineConfig.__post_init__ = _post_init_for_tests


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
