"""What the engine's fork server imports starts no OpenMP pool; a fork server started early is the one used.

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


EARLY = """
import multiprocessing.forkserver as fs
from asyncbatch.engine.fork_server import start_early
start_early()
early = fs._forkserver._forkserver_pid
from asyncbatch import LLM, SamplingParams
with LLM("smollm2-135m", device="sim", skip_tokenizer_init=True) as llm:
    core = llm._client.process.pid
    parent = next(int(line.split()[1]) for line in open(f"/proc/{core}/status") if line.startswith("PPid:"))
    tokens = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids
print(early, parent, len(tokens))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the core's parent from /proc")
def test_a_fork_server_started_early_is_the_one_the_core_starts_from():
    """``start_early`` (what ``asyncbatch serve`` and the CLI's engine commands call before their own imports):
    the fork server it starts is the one the engine's core is then forked from, and the engine serves."""
    done = subprocess.run([sys.executable, "-c", EARLY], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    early, parent, tokens = done.stdout.split()[-3:]
    assert early != "None" and early == parent and tokens == "3", done.stdout
