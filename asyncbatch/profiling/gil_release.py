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
# A release as short as numpy's casting scatter of 256 ids (about a microsecond) is seen only when the OS wakes
# the waiter inside it: on 3 to 35 % of tries on an idle 2-vCPU Zen 1 VM, run to run, and on far fewer while
# other processes hold both cores (20 tries saw none in 12 rounds of 30 idle, and failed a CI run; 400 saw none
# in 1 run of 12 beside two spinning processes). So ``let_go`` asks for 400, and a control that must be seen
# asks ``first_release`` to go on until it is.
TRIES = 400
CONTROL_TRIES = 10_000


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

    def let_go(self, operation: Callable[[], object], tries: int = TRIES) -> int:
        """Of ``tries`` calls of ``operation``, how many let the GIL go (see ``TRIES`` for how many to ask)."""
        released = 0
        for _ in range(tries):
            time.sleep(0.001)  # the waiter runs now, and is waiting for the GIL when the operation starts
            before = self.count
            operation()
            released += self.count != before
        return released

    def first_release(self, operation: Callable[[], object], tries: int = CONTROL_TRIES) -> int | None:
        """The try (from 1) at which ``operation`` was first seen to let the GIL go, or None within ``tries``:
        for a control, which costs a few tries on an idle machine and goes on through a loaded spell."""
        for attempt in range(1, tries + 1):
            if self.let_go(operation, tries=1):
                return attempt
        return None
