"""A thread that plays the device for the ``cpu`` and ``sim`` backends.

    planner thread         device thread
    launch(N) ──queue──►   copy staging → fence.signal() → run step N → handle.set_result
    launch(N+1) ─queue─►   (waits in queue.get until step N is done)
    wait(N) ◄──────────────────────────────────────────────┘

Steps run strictly in launch order. An exception while running a step goes to
that step's handle (and so to whoever waits on it); the thread keeps serving
until ``stop``. ``on_start`` runs first on the thread (the ``cpu`` backend
claims its kernel threads there, ``kernel_threads``), and ``call`` runs other
one-off work on it in the same queue (a compile warm-up).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from asyncbatch.engine.step_contract import StepMeta
from asyncbatch.executors.base import Executor, StepHandle, StepResult

_STOP = object()
T = TypeVar("T")


class DeviceThread:
    def __init__(self, name: str, run_step: Callable[[StepMeta, StepHandle], StepResult],
                 on_start: Callable[[], None] | None = None) -> None:
        self._run_step = run_step
        self._on_start = on_start
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, meta: StepMeta, handle: StepHandle) -> None:
        self._queue.put((meta, handle))

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread after what is queued, and return its result (or raise its error)."""
        done: Future = Future()
        self._queue.put((fn, done))
        return done.result()

    def _loop(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            meta, handle = item
            if isinstance(handle, Future):  # ``call``
                try:
                    handle.set_result(meta())
                except BaseException as exc:  # noqa: BLE001 - raised in the caller
                    handle.set_exception(exc)
                continue
            try:
                handle.set_result(self._run_step(meta, handle))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiting planner
                meta.staging.fence.signal()
                handle.set_error(exc)

    def stop(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class ThreadedExecutor(Executor):
    """An executor whose device is a ``DeviceThread`` (``cpu``, ``sim``): launch queues, wait blocks."""

    _thread: DeviceThread | None = None

    def launch(self, meta: StepMeta) -> StepHandle:
        handle = StepHandle(meta.step_id, time.perf_counter())
        self._thread.submit(meta, handle)
        return handle

    def wait(self, handle: StepHandle) -> StepResult:
        return handle.result()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
