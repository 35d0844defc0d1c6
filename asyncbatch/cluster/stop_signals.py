"""SIGTERM and SIGINT for ``asyncbatch serve --replicas N``: a flag the main thread waits on, not an exit.

``ray.init`` installs its own SIGTERM handler in the driver (Ray's C++ failure handler, which logs the
signal and aborts: exit status -6, and nothing is drained or shut down), and SIGINT's default raises
``KeyboardInterrupt`` wherever the main thread happens to be. Both are replaced here, so a stop signal
only records itself and the main thread drains and shuts down in order (``lifecycle``). ``install`` must
be called again after ``ray.init``, which replaced the handler.

    1st signal ─► stop requested: drain (finish in-flight requests within --shutdown-timeout)
    2nd signal ─► hurry: abort what is still in flight now (Ray is still shut down in order)

While ``interrupt`` is set, the signal that brings the count to ``interrupt_at`` also raises it in the main
thread, to leave a start that has nothing to drain yet (``lifecycle``).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Counts stop signals; ``wait`` blocks until the first. Only the main thread may ``install``."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.count = 0
        self.last: int | None = None
        self._previous: dict[int, object] = {}
        # Raised by the handler at the interrupt_at-th signal while set; None: only record.
        self.interrupt: type[BaseException] | None = None
        self.interrupt_at = 1

    def install(self) -> None:
        for sig in SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.last = signum
        self._stop.set()
        if self.interrupt is not None and self.count >= self.interrupt_at:
            raise self.interrupt(signum)

    @property
    def requested(self) -> bool:
        return self._stop.is_set()

    @property
    def hurry(self) -> bool:
        """A second signal came: stop waiting for in-flight requests."""
        return self.count >= 2

    def wait(self, timeout: float | None = None) -> bool:
        """True once a stop signal came (Python runs handlers in the main thread between waits)."""
        return self._stop.wait(timeout)
