"""Output processing: the thread that turns sampled ids into text for callers.

It runs beside the planner and never blocks it (DESIGN invariant 5):

    planner      [apply N: ids, EOS, frees] ──queue──► output  [detok N, stop strings, stream N]
    planner      [plan N+2] ...                         output  (idle)
    planner  ◄── stop-string finish of request R ─────  output
             (frees R's blocks at its next iteration; tokens R got meanwhile are dropped)

Tokens that arrive for a request after it finished (the step it was still in
when its stop was seen) are dropped here: never emitted, never counted.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncbatch.engine.request import Request
from asyncbatch.outputs import StreamDelta
from asyncbatch.profiling.marks import mark
from asyncbatch.profiling.timeline import StepRecord


@dataclass(slots=True)
class RequestUpdate:
    request: Request
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


@dataclass(slots=True)
class OutputBatch:
    updates: list[RequestUpdate]
    record: StepRecord | None = None
    processed: threading.Event | None = None  # set once handled (the synchronous planner waits on it)


_STOP = object()


class OutputProcessor:
    def __init__(self, on_stop_string: Callable[[Request, str], None], on_error: Callable[[BaseException], None],
                 hidden_token_ids: frozenset[int], on_request_error: Callable[[Request], None]) -> None:
        self._on_stop_string = on_stop_string
        self._on_error = on_error
        self._on_request_error = on_request_error
        self._hidden = hidden_token_ids  # EOS/stop ids: kept in token_ids, not detokenized
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="asyncbatch-output", daemon=True)
        self._thread.start()

    def put(self, batch: OutputBatch) -> None:
        self._queue.put(batch)

    def _loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _STOP:
                return
            try:
                self._process(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to the engine, which fails every caller
                self._on_error(exc)
            finally:
                if batch.processed is not None:
                    batch.processed.set()

    def _process(self, batch: OutputBatch) -> None:
        start = time.perf_counter()
        accepted = 0
        finishes: list[tuple] = []
        step_id = batch.record.step_id if batch.record else None
        with mark("output", step_id), mark("detokenize", step_id):
            for update in batch.updates:
                try:
                    accepted += self._apply(update, start, finishes)
                except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                    self._fail_request(update.request, exc)
        if batch.record is not None:
            batch.record.output_start = start
            batch.record.output_end = time.perf_counter()
            batch.record.output_tokens = accepted
        # Callers wake only now, so a caller reading stats() after its request finished sees this step.
        for handle, args in finishes:
            handle.finish(*args)

    def _apply(self, update: RequestUpdate, now: float, finishes: list[tuple]) -> int:
        handle = update.request.handle
        if handle.finished:
            return 0
        if handle.metrics.first_token_time is None and update.new_token_ids:
            handle.metrics.first_token_time = now
        emitted = ""
        new_ids: list[int] = []
        stop_params = update.request.params.stop_token_ids or ()
        for token in update.new_token_ids:
            handle.token_ids.append(token)
            new_ids.append(token)
            if token in self._hidden or token in stop_params:
                continue
            feed = handle.stops.feed(handle.detokenizer.push(token))
            emitted += feed.emit
            if feed.stopped:
                handle.text += emitted
                self._emit(handle, emitted, new_ids)
                finishes.append((handle, ("stop", feed.matched, now)))
                self._on_stop_string(update.request, feed.matched)
                return len(new_ids)
        if update.finish_reason is not None:
            emitted += handle.stops.feed(handle.detokenizer.finish()).emit + handle.stops.flush()
        handle.text += emitted
        self._emit(handle, emitted, new_ids)
        if update.finish_reason is not None:
            finishes.append((handle, (update.finish_reason, update.stop_reason, now, update.error)))
        return len(new_ids)

    def _fail_request(self, request: Request, exc: Exception) -> None:
        """Detokenizing or streaming this request raised: fail it alone and have the planner free it."""
        if not request.handle.finished:
            request.handle.finish("error", None, time.perf_counter(), error=f"output processing failed: {exc!r}")
        self._on_request_error(request)

    @staticmethod
    def _emit(handle, text: str, token_ids: list[int]) -> None:
        if handle.streaming and (text or token_ids):
            handle.deltas.put(StreamDelta(handle.request_id, text, token_ids))

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
