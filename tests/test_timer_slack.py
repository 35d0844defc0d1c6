"""The simulated device's thread sleeps with a 1 us timer slack (executors/timer_slack.py)."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from asyncbatch.executors.timer_slack import fine_timer_slack, set_thread_timer_slack

_PR_GET_TIMERSLACK = 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl timer slack is Linux's")
def test_the_slack_is_set_for_the_calling_thread_only():
    libc = ctypes.CDLL(None)
    seen: dict[str, int] = {}

    def device() -> None:
        fine_timer_slack()
        seen["device"] = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)

    before = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    thread = threading.Thread(target=device)
    thread.start()
    thread.join()
    assert seen["device"] == 1000
    assert libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) == before  # this thread's own slack is untouched


def test_elsewhere_it_says_it_could_not(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert set_thread_timer_slack(1000) is False
