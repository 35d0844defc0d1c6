"""What the engine's fork server imports starts no OpenMP pool.

Core processes are forked from a server that imported ``asyncbatch.engine.core_preload``. GNU OpenMP does not
survive a fork once its pool has started: the child's first parallel torch op (a large ``torch.zeros`` while
building the staging buffers) waits forever for workers that were not forked. A module that runs a parallel
torch op at import (a probe over a 4,096-wide tensor, once) hung every engine start of the suite this way. An
OpenMP pool shows as threads of the process, so the import must leave as many threads as importing torch does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COUNT = "import os, {module}; print(len(os.listdir('/proc/self/task')))"


def _threads_after_import(module: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a pool of two would start a worker thread
    out = subprocess.run([sys.executable, "-c", COUNT.format(module=module)], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_the_fork_servers_imports_start_no_thread_pool():
    assert _threads_after_import("asyncbatch.engine.core_preload") == _threads_after_import("torch")
