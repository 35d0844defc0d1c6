"""``kill -USR1``'s stack dump (``profiling.stack_dump``) on a process whose other threads are busy in Python."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from asyncbatch.profiling.stack_dump import DUMP_HEADER
from tests.serve_harness import ROOT, read_shared_log

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="SIGUSR1 is POSIX only")

# Two threads that import and build classes without pause: their frames come and go all the time. faulthandler's
# register() read them from the C signal handler while they ran and died of SIGSEGV within 2-7 signals here.
_CHURN = """
import importlib, sys, threading, time
from asyncbatch.profiling.stack_dump import dump_stacks_on_signal

def churn():
    while True:
        # list() copies the keys in one C call: iterating sys.modules itself while the other thread imports raised
        # "dictionary changed size during iteration" and killed this thread (a CI run's dump then held its traceback).
        for name in [m for m in list(sys.modules) if m.startswith("json")]:
            sys.modules.pop(name, None)
        try:
            importlib.import_module("json")
        except (ImportError, KeyError):  # the other thread took a json module out in the middle of the import
            pass
        type("C", (), {"f": lambda self: 1})().f()

assert dump_stacks_on_signal()
for i in range(2):
    threading.Thread(target=churn, name=f"churn-{i}", daemon=True).start()
print("ready", flush=True)
# The main thread waits in bounded sleeps, as the processes that register the dump do (the engine core polls its
# pipe every 0.5 s, uvicorn ticks every 0.1 s): a signal that lands just before the main thread enters a sleep
# runs its handler only when that sleep ends (stack_dump's docstring), so one long sleep would hold a dump up.
for _ in range(240):
    time.sleep(0.5)
"""


def test_dumps_survive_threads_busy_in_python_and_name_every_thread() -> None:
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-c", _CHURN], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            _wait_for(log, lambda text: "ready" in text, proc)
            resent = 0
            for n in range(1, 31):  # one at a time: signals that arrive together are handled once
                proc.send_signal(signal.SIGUSR1)
                # CPython loses, now and then, a signal whose C handler ran on another thread (python/cpython#75302;
                # stack_dump's docstring): a dump that has not come within seconds is asked for again, as an operator
                # would, a few times at most.
                while not _wait_for(log, lambda text, n=n: text.count(DUMP_HEADER) >= n, proc, within_s=5.0,
                                    fail=resent >= 3):
                    resent += 1
                    proc.send_signal(signal.SIGUSR1)
            alive = proc.poll() is None
        finally:
            proc.kill()
            proc.wait(10)
        dumps = read_shared_log(log).split(DUMP_HEADER)[1:]
    assert alive and 30 <= len(dumps) <= 30 + resent
    for dump in dumps:
        assert '"churn-0" daemon' in dump and '"churn-1" daemon' in dump and '"MainThread"' in dump, dump
        assert dump.count(", in churn\n") == 2, dump  # both busy threads' own frames, read whole


def _wait_for(log, done, proc: subprocess.Popen, within_s: float = 20.0, fail: bool = True) -> bool:
    """Wait until ``done(log text)``; True then. Past ``within_s``: an AssertionError, or False if not ``fail``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if done(read_shared_log(log)):
            return True
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (status {proc.returncode}):\n{read_shared_log(log)[-3000:]}")
        time.sleep(0.02)
    if fail:
        raise AssertionError(f"not within {within_s} s:\n{read_shared_log(log)[-3000:]}")
    return False
