"""The interpreter's thread switch interval, shortened while any engine runs.

A thread that wants the GIL waits up to the switch interval for the holder to
let go. The device thread (and on CUDA the planner's launches) need the GIL
back right after each step; CPython's default of 5 ms is longer than a decode
step, so engines ask for a shorter one (``EngineConfig.switch_interval_s``).
The setting is process-wide: the smallest request among live engines wins,
and the original value comes back when the last engine closes.
"""

from __future__ import annotations

import sys
import threading

_switch_lock = threading.Lock()
_switch_holders: list[float] = []  # the interval each live engine asked for
_switch_original: float | None = None


def hold_switch_interval(seconds: float) -> None:
    """Shorten the interpreter's switch interval while any engine runs; restored when the last closes."""
    global _switch_original
    with _switch_lock:
        if not _switch_holders:
            _switch_original = sys.getswitchinterval()
        _switch_holders.append(seconds)
        sys.setswitchinterval(min(_switch_original, *_switch_holders))


def release_switch_interval(seconds: float) -> None:
    with _switch_lock:
        _switch_holders.remove(seconds)
        if _switch_holders:
            sys.setswitchinterval(min(_switch_original, *_switch_holders))
        elif _switch_original is not None:
            sys.setswitchinterval(_switch_original)
