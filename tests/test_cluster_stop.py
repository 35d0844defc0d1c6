"""The cluster server's stop machinery without starting Ray: stop signals only record themselves (no
``KeyboardInterrupt``, no abort), a second one hurries, and processes left after ``ray.shutdown()`` are ended
with SIGTERM and, if they ignore it as Ray's agents did, SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="the cluster extra is not installed (pip install -e '.[cluster]')")
psutil = pytest.importorskip("psutil", reason="the cluster extra is not installed (pip install -e '.[cluster]')")

from asyncbatch.cluster.ray_processes import end_processes
from asyncbatch.cluster.stop_signals import StopSignals


class Stop(BaseException):
    pass


def test_stop_signals_record_then_hurry_then_restore():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signals = StopSignals()
    signals.install()
    try:
        assert not signals.requested and not signals.wait(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: only recorded
        assert signals.wait(5) and signals.requested and not signals.hurry and signals.last == signal.SIGINT
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.wait(5) and signals.hurry and signals.count == 2
        signals.interrupt, signals.interrupt_at = Stop, 3  # while starting: leave at once
        with pytest.raises(Stop):
            os.kill(os.getpid(), signal.SIGTERM)
            signals.wait(5)
    finally:
        signals.restore()
    assert {sig: signal.getsignal(sig) for sig in before} == before


def _sleeper(ignore_term: bool) -> subprocess.Popen:
    code = ("import signal, sys, time\n"
            f"if {ignore_term}: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_leftovers_get_sigterm_then_sigkill_if_they_ignore_it():
    polite, stubborn = _sleeper(False), _sleeper(True)
    try:
        left = end_processes([psutil.Process(polite.pid), psutil.Process(stubborn.pid)], grace_s=0.2, term_s=1.0)
        assert not psutil.pid_exists(polite.pid) and not psutil.pid_exists(stubborn.pid)  # reaped, too
        assert len(left.terminated) == 2
        assert [k.rsplit("(", 1)[1] for k in left.killed] == [f"{stubborn.pid})"]
        assert end_processes([]) == type(left)([], [])  # nothing to end
    finally:
        for p in (polite, stubborn):
            p.kill()
            p.wait()


def test_a_joined_cluster_loses_only_our_application_an_owned_ray_everything(monkeypatch):
    from asyncbatch.cluster import lifecycle

    calls: list = []
    monkeypatch.setattr(lifecycle.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(lifecycle.ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(lifecycle.serve, "delete", lambda name: calls.append(("serve.delete", name)))
    monkeypatch.setattr(lifecycle.serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(lifecycle, "shutdown_owned_ray", lambda: calls.append("end the Ray this server started"))
    lifecycle.teardown(owned=False)  # --address: the cluster and its other applications keep running
    assert calls == [("serve.delete", "asyncbatch"), "ray.shutdown"]
    calls.clear()
    lifecycle.teardown(owned=True)
    assert calls == ["serve.shutdown", "end the Ray this server started"]
