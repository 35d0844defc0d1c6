"""Peak memory of a system: its persistent tensors, counted exactly, plus what a run adds.

Several systems share one process, so neither ``ru_maxrss`` (a process-lifetime
maximum) nor RSS growth while a system is built can be attributed to it: the
allocator hands a new system the memory an earlier one freed. A system's
figure is therefore

    peak_mib = state_mib          bytes of its weights, buffers and preallocated KV cache
             + in_run_state_mib   KV cache a run allocates itself (transformers' manager)
             + transient_mib      RSS growth above the run's start beyond that (activations,
                                  a growing DynamicCache), sampled from /proc/self/statm

``transient_mib`` is approximate (it undercounts when freed memory is reused);
the state terms are exact. RSS is sampled every ``interval_s`` (20 ms: about
20 us of GIL per sample). On CUDA the device allocator's peak is reported too.
"""

from __future__ import annotations

import os
import threading

import torch

from asyncbatch.profiling.memory import module_mib, tensor_mib  # noqa: F401 - re-exported

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
    """``with MemorySampler() as m: ...`` then ``m.result(state_mib)``."""

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

    def result(self, state_mib: float, in_run_state_mib: float = 0.0) -> dict:
        delta = max(self.peak_mib - self.start_mib, 0.0)
        transient = max(delta - in_run_state_mib, 0.0)
        out = {"state_mib": state_mib, "in_run_state_mib": in_run_state_mib, "run_delta_mib": delta,
               "transient_mib": transient, "peak_mib": state_mib + in_run_state_mib + transient,
               "process_peak_rss_mib": self.peak_mib}
        if self._cuda:
            out["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / _MIB
        return out
