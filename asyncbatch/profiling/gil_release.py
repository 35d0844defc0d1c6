"""Seeing whether code let go of the GIL, without a clock.

The planner thread shares its process's GIL with the sender and the device thread: an operation that
releases it on the device's critical path may wait for whichever thread took it (numpy does so inside a
scatter that casts, and in any loop past its 500-element threshold; docs/performance.md).

A ``GilWatch`` runs a thread that advances a counter and hands the GIL straight back, while the process's
switch interval is a minute: that thread then runs only when the GIL's holder lets go of it (a C call that
releases it, a blocking call), so the counter moves across a piece of code exactly when the code let go::

    holder   [op ............................................][op ...]
    waiter      waits for the GIL ──► runs only inside a release ──► counter + 1

Nothing is timed, so a loaded machine can only miss a release (the waiter not scheduled while it lasts),
never invent one.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

_WATCH_SWITCH_INTERVAL_S = 60.0


class GilWatch:
    """A waiting thread and its counter (``with GilWatch() as watch: ...``); process-wide while open."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._wait, name="gil-watch", daemon=True)
        self._old_interval = sys.getswitchinterval()

    def __enter__(self) -> GilWatch:  # noqa: PYI034 - typing.Self needs Python 3.11; 3.10 is supported
        sys.setswitchinterval(_WATCH_SWITCH_INTERVAL_S)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        sys.setswitchinterval(self._old_interval)
        self._thread.join(5)

    def _wait(self) -> None:
        while not self._stop.is_set():
            self.count += 1
            time.sleep(0)  # hands the GIL back at once; the next turn waits for it again

    def let_go(self, operation: Callable[[], object], tries: int = 20) -> int:
        """Of ``tries`` calls of ``operation``, how many let the GIL go."""
        released = 0
        for _ in range(tries):
            time.sleep(0.001)  # the waiter runs now, and is waiting for the GIL when the operation starts
            before = self.count
            operation()
            released += self.count != before
        return released
