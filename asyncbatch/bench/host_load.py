"""How much of the machine other processes took during a run.

On a shared machine the wall time of a run depends on everyone else's jobs.
``HostLoad`` brackets a run and reports the CPU-seconds every other process
used meanwhile (all CPUs' busy time from ``/proc/stat`` minus this process's
own), as a fraction of the CPU capacity of the window: 0 means the machine was
ours, 0.5 means others took half of it. Runs with high contention are the
ones to distrust; the report keeps this figure next to each run.
"""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_cpu_s() -> float | None:
    """CPU-seconds all CPUs spent busy since boot (None where /proc/stat is missing)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # guest time is already counted in user
    return (sum(fields) - idle - guest) / _TICK


class HostLoad:
    """``with HostLoad() as h: run()`` then ``h.result()``."""

    def __enter__(self) -> HostLoad:  # noqa: PYI034 - not meant to be subclassed
        self._wall0, self._proc0, self._busy0 = time.perf_counter(), time.process_time(), busy_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wall1, self._proc1, self._busy1 = time.perf_counter(), time.process_time(), busy_cpu_s()

    def result(self) -> dict:
        wall = max(self._wall1 - self._wall0, 1e-9)
        own = self._proc1 - self._proc0
        out: dict = {"process_cpu_s": own, "others_cpu_s": None, "contention": None}
        if self._busy0 is not None and self._busy1 is not None:
            others = max(self._busy1 - self._busy0 - own, 0.0)
            out["others_cpu_s"] = others
            out["contention"] = min(others / (wall * (os.cpu_count() or 1)), 1.0)
        return out
