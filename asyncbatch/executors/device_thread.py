"""Threads that play the device for the ``cpu`` and ``sim`` backends.

    planner thread         device thread
    launch(N) ──queue──►   copy staging → fence.signal() → run step N → handle.set_result
    launch(N+1) ─queue─►   (waits in queue.get until step N is done)
    wait(N) ◄──────────────────────────────────────────────┘

Steps run strictly in launch order. An exception while running a step goes to
that step's handle (and so to whoever waits on it); the thread keeps serving
until ``stop``. ``on_start`` runs first on the thread (the ``cpu`` backend
claims its kernel threads there, ``kernel_threads``), and ``call`` runs other
one-off work on it in the same queue (a compile warm-up).

``PipelinedDeviceThread`` (the ``sim`` backend) models a device queue whose
step times are known in advance: it prepares step N+1 as soon as it is
launched, while step N's modelled time runs, and only delivers results at the
modelled ends (see its docstring).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from asyncbatch.engine.step_contract import StepMeta
from asyncbatch.executors.base import Executor, StepHandle, StepResult

_STOP = object()
T = TypeVar("T")


class DeviceThread:
    """``run_step`` runs one step on this thread (None: a subclass's ``_loop`` runs steps its own way)."""

    def __init__(self, name: str, run_step: Callable[[StepMeta, StepHandle], StepResult] | None,
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
                _run_call(meta, handle)
                continue
            try:
                handle.set_result(self._run_step(meta, handle))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiting planner
                _fail_step(meta, handle, exc)

    def stop(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _run_call(fn: Callable[[], object], done: Future) -> None:
    """A ``call``'s function, its result or error for the caller."""
    try:
        done.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - raised in the caller
        done.set_exception(exc)


def _fail_step(meta: StepMeta, handle: StepHandle, exc: BaseException) -> None:
    """A step that raised: its staging is free again and its error goes to whoever waits on it."""
    meta.staging.fence.signal()
    handle.set_error(exc)


def get_within(q: queue.SimpleQueue, timeout: float) -> object:
    """``q.get(timeout=timeout)`` for ``q``'s one consumer, without the wait that never ends.

    CPython 3.11's ``SimpleQueue.get(timeout=t)`` on an empty queue whose internal lock is free takes the lock
    at once, then recomputes the time left; when the thread lost more than ``t`` (+1 us) in between (a
    descheduled thread, a short ``t``), the time left is negative, which its lock wait reads as "forever": the
    call returns only at the next ``put``. (``asyncbatch serve --device sim`` stopped for good that way, rarely,
    under load: the planner in ``StepHandle.result``, the device loop here; a 2 us timeout does it within
    seconds, ``tests/test_pipelined_device_thread.py``.) A ``get_nowait`` first leaves the lock taken when the
    queue is empty, so the timed call waits on the lock with the whole positive timeout, which ends at the
    deadline or at a ``put``. Left: a signal interrupting that wait past the deadline (``SimpleQueue`` then
    recomputes again); nothing signals this process's threads while it runs. ``queue.Queue`` has no such case
    but cost the simulated device 0.5-0.9 points of busy time at 1 ms steps."""
    try:
        return q.get_nowait()
    except queue.Empty:
        pass
    return q.get(timeout=timeout)


@dataclass(slots=True)
class PreparedStep:
    """A step whose work is done but whose modelled end may lie ahead (``PipelinedDeviceThread``).

    ``complete`` waits for ``end`` (and whatever else the step waits for, a grammar mask) and returns the result.
    ``final``: everything a later step reads from this one (device token buffer, device state) is written
    already, so the next step may be prepared before this one completes."""

    end: float
    final: bool
    complete: Callable[[], StepResult]


class PipelinedDeviceThread(DeviceThread):
    """A device thread that prepares the next step during the current step's modelled time (the ``sim`` backend).

        planner   launch N         launch N+1                      launch N+2
        thread    [prepare N][sleep ........ ][deliver N][sleep .......... ][deliver N+1]
                                 [prepare N+1]                [prepare N+2]
        device    [............ step N ......][.......... step N+1 .........][... N+2 ...

    The plain ``DeviceThread`` prepares step N+1 (copies, pseudo-tokens: host work holding the GIL) only once
    step N is delivered, which is when the planner applies N and plans N+2: both then want the GIL at the same
    moment, and on a busy 2-core host the simulated results came back up to a step late (a real device's queue
    has no such work). Here ``prepare`` runs when the step is launched (the planner's slack), and what is left
    at the modelled end is waking up and delivering. Results are delivered in launch order, each at its modelled
    end; a step that is not ``final`` (its tokens wait for a grammar mask) is completed before the next one is
    prepared, and ``call`` work runs after every pending step has completed. ``when_idle`` runs before a
    step's ``prepare`` when nothing is pending (so it may wait without holding back a delivery).

    The loop waits for the next launch at most until the oldest step's end: ``get_within``, not
    ``SimpleQueue.get(timeout=...)``, which can block until the next launch however long (see there). The
    planner, waiting for the step this thread was about to deliver, then never launches again."""

    def __init__(self, name: str, prepare: Callable[[StepMeta, StepHandle], PreparedStep],
                 on_start: Callable[[], None] | None = None,
                 when_idle: Callable[[StepMeta, StepHandle], None] | None = None) -> None:
        self._prepare = prepare
        # Runs before ``prepare`` when no earlier step is pending (nothing to deliver meanwhile): it may wait for
        # a moment when the host's work leaves the interpreter free (``SimExecutor._wait_for_host_gap``).
        self._when_idle = when_idle
        super().__init__(name, None, on_start)

    def _loop(self) -> None:
        if self._on_start is not None:
            self._on_start()
        pending: deque[tuple[PreparedStep, StepHandle]] = deque()
        while True:
            item = None
            if not pending:
                item = self._queue.get()
            else:
                wait = pending[0][0].end - time.perf_counter()
                if wait > 0 and pending[-1][0].final:
                    try:
                        item = get_within(self._queue, wait)
                    except queue.Empty:
                        item = None
                if item is None:  # the oldest step's end has come: deliver it
                    self._complete(*pending.popleft())
                    continue
            if item is _STOP or isinstance(item[1], Future):
                while pending:  # steps before a stop or a call complete first, in order
                    self._complete(*pending.popleft())
                if item is _STOP:
                    return
                _run_call(*item)
                continue
            meta, handle = item
            try:
                if not pending and self._when_idle is not None:
                    self._when_idle(meta, handle)
                pending.append((self._prepare(meta, handle), handle))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiting planner
                _fail_step(meta, handle, exc)

    @staticmethod
    def _complete(step: PreparedStep, handle: StepHandle) -> None:
        try:
            handle.set_result(step.complete())
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiting planner
            handle.set_error(exc)


class ThreadedExecutor(Executor):
    """An executor whose device is a ``DeviceThread`` (``cpu``, ``sim``): launch queues, wait blocks."""

    _thread: DeviceThread | None = None

    def launch(self, meta: StepMeta) -> StepHandle:
        handle = StepHandle(meta.step_id, time.perf_counter())
        self._thread.submit(meta, handle)
        return handle

    def wait(self, handle: StepHandle) -> StepResult:
        handle.mark_awaited()
        return handle.result()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
