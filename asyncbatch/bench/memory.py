"""Peak memory of a run: resident set size sampled by a background thread, and CUDA peaks.

``ru_maxrss`` is a process-lifetime maximum, useless when several systems run
in one process, so RSS is read from ``/proc/self/statm`` every ``interval_s``
(20 ms: about 20 us of GIL per sample, under 0.1% of a run). A system's
figure is what it added: ``load_mib`` (RSS growth while it was built: weights,
preallocated KV cache) plus ``run_delta_mib`` (RSS growth above the level at the
start of the run: activations, caches allocated per run). On CUDA the device
allocator's peak is reported too.
"""

from __future__ import annotations

import os
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MIB = 1 << 20


def rss_mib() -> float:
    """Current resident set size of this process in MiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE / _MIB
    except (OSError, IndexError, ValueError):
        return 0.0


class MemorySampler:
    """``with MemorySampler() as m: ...`` then ``m.result(load_mib)``."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.start_mib = 0.0
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cuda = torch.cuda.is_available()

    def __enter__(self) -> MemorySampler:  # noqa: PYI034 - not meant to be subclassed
        self.start_mib = self.peak_mib = rss_mib()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        self._thread = threading.Thread(target=self._loop, name="bench-memory", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mib = max(self.peak_mib, rss_mib())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_mib = max(self.peak_mib, rss_mib())

    def result(self, load_mib: float) -> dict:
        delta = max(self.peak_mib - self.start_mib, 0.0)
        out = {"load_mib": load_mib, "run_delta_mib": delta, "peak_mib": load_mib + delta,
               "process_peak_rss_mib": self.peak_mib}
        if self._cuda:
            out["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / _MIB
        return out
