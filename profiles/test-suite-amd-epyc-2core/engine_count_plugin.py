"""A pytest plugin (profiles only): how many engines each test module builds, and how long their constructors take.

    PYTHONPATH=profiles/test-suite-amd-epyc-2core python -m pytest -q -n 2 --dist loadscope \\
        --no-loadscope-reorder -m "not exclusive" -p engine_count_plugin

Each process (each xdist worker) writes ``/tmp/engine_count_<worker>.json`` at exit: rows of [module, kind,
engines, seconds], kind being ``<device>-ep<engine_process>`` for ``LLM`` and ``AsyncLLM`` for the server's.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import time

import pytest

from asyncbatch import llm as llm_module

_stats: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0, 0.0])
_current = {"module": "?"}


def _timed(init, kind_of):
    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return init(self, *args, **kwargs)
        finally:
            entry = _stats[_current["module"], kind_of(kwargs)]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
    return wrapper


llm_module.LLM.__init__ = _timed(llm_module.LLM.__init__,
                                 lambda kw: f"{kw.get('device', 'auto')}-ep{kw.get('engine_process')}")
try:
    from asyncbatch.serve import async_llm
except ImportError:  # the serve extra is not installed
    pass
else:
    async_llm.AsyncLLM.__init__ = _timed(async_llm.AsyncLLM.__init__, lambda kw: "AsyncLLM")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _current["module"] = item.nodeid.split("::", 1)[0]


@atexit.register
def _dump() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"/tmp/engine_count_{worker}.json", "w") as f:
        json.dump([[module, kind, n, s] for (module, kind), (n, s) in _stats.items()], f)
