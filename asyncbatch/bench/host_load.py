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


def process_group_cpu_s(pgid: int) -> float | None:
    """CPU-seconds (user + system) that the live processes of process group ``pgid`` have used: a server
    started in its own session and its children (an engine core). None where /proc is missing."""
    total, found = 0.0, False
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The command name may hold spaces and parentheses: the fields start after the last ')'.
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if len(fields) > 12 and int(fields[2]) == pgid:  # state, ppid, pgrp, ..., utime [11], stime [12]
            total += (int(fields[11]) + int(fields[12])) / _TICK
            found = True
    return total if found else None


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


class ServerLoad:
    """``HostLoad`` for a client (this process) and a server (process group ``pgid``): each one's CPU
    seconds in the window, and the share of the CPUs everything else took. With ``pgid`` None (a server
    this benchmark did not start) the server's CPU cannot be told from other processes' and
    ``contention`` is None."""

    def __init__(self, pgid: int | None) -> None:
        self.pgid = pgid

    def _server_cpu_s(self) -> float | None:
        return None if self.pgid is None else process_group_cpu_s(self.pgid)

    def __enter__(self) -> ServerLoad:  # noqa: PYI034 - not meant to be subclassed
        self._wall0, self._proc0, self._busy0 = time.perf_counter(), time.process_time(), busy_cpu_s()
        self._server0 = self._server_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wall1, self._proc1, self._busy1 = time.perf_counter(), time.process_time(), busy_cpu_s()
        self._server1 = self._server_cpu_s()

    def result(self) -> dict:
        wall = max(self._wall1 - self._wall0, 1e-9)
        client = self._proc1 - self._proc0
        server = None if self._server0 is None or self._server1 is None else self._server1 - self._server0
        out: dict = {"wall_s": wall, "client_cpu_s": client, "server_cpu_s": server, "others_cpu_s": None,
                     "contention": None}
        if server is not None and self._busy0 is not None and self._busy1 is not None:
            others = max(self._busy1 - self._busy0 - client - server, 0.0)
            out["others_cpu_s"] = others
            out["contention"] = min(others / (wall * (os.cpu_count() or 1)), 1.0)
        return out
