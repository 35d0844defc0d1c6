"""The interface every benchmarked system implements, and the settings they share.

Equal work across systems: the same requests (token ids), the same per-request
output limits, the same model weights, dtype and device, the same sampling
(greedy by default) and the same EOS rule (``ignore_eos`` runs every request to
its limit). Timed windows exclude building the system and warm-up.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass

from asyncbatch.bench.workloads import WorkItem
from harness.records import RunResult


@dataclass(slots=True)
class BenchSettings:
    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str | None = None  # asyncbatch only: the cpu weight precision (int8, int4, w8a8)
    num_threads: int | None = None  # cpu: torch threads of asyncbatch's engine and llama.cpp's threads (None: all)
    temperature: float = 0.0
    ignore_eos: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    static_batch_size: int = 8
    seed: int = 0
    enable_prefix_caching: bool = True  # asyncbatch only

    def as_dict(self) -> dict:
        return asdict(self)


class BenchSystem(ABC):
    """A system under test. ``run_offline`` submits everything at once; ``run_online``
    submits request ``i`` at ``offsets[i]`` seconds and consumes every request as a stream."""

    name: str = ""
    description: str = ""
    load_mib: float = 0.0  # MiB of the system's persistent tensors (weights, buffers, preallocated KV cache)

    @abstractmethod
    def run_offline(self, items: list[WorkItem]) -> RunResult: ...

    @abstractmethod
    def run_online(self, items: list[WorkItem], offsets: list[float]) -> RunResult: ...

    def warmup(self, items: list[WorkItem]) -> None:
        self.run_offline(items)

    def config(self) -> dict:
        """What this system was configured with, for the JSON report."""
        return {}

    def close(self) -> None:
        pass


def replay(offsets: list[float], submit: Callable[[int], None]) -> float:
    """Call ``submit(i)`` at ``start + offsets[i]`` (perf_counter seconds, ``start`` = now), in order;
    returns ``start``.

    Sleeps until each arrival instead of spinning, so the dispatcher costs the
    systems under test no CPU; lateness is the OS wake-up delay, identical for all.
    """
    start = time.perf_counter()
    for i, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submit(i)
    return start


def timed_replay(offsets: list[float], submit: Callable[[int], None],
                 join: Callable[[], None]) -> tuple[float, float, float]:
    """``replay`` the arrivals, then ``join()`` the workers: (start, end, CPU seconds this process spent)."""
    cpu0 = time.process_time()
    start = replay(offsets, submit)
    join()
    return start, time.perf_counter(), time.process_time() - cpu0


class ThreadErrors:
    """Collects exceptions raised in worker threads so the caller can re-raise the first one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors: list[BaseException] = []

    def add(self, error: BaseException) -> None:
        with self._lock:
            self.errors.append(error)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]
