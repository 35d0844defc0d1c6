"""The planner thread: schedules, fills staging buffers, launches, and applies results.

One loop serves both modes; they differ only in how many launched steps may
be outstanding (``overlap=True``: two, ``overlap=False``: one) and in whether
the planner waits for output processing before planning again.

Overlap mode (the planner runs one step ahead of the device):

    planner  [plan N+1][launch N+1][wait N ][apply N][plan N+2][launch N+2][wait N+1]...
    device   [........ step N ..........][.......... step N+1 .........][ step N+2 ..
    output                                                   [detok N, stops N]   [detok N+1]

(step N's outputs go to the output thread once N+2 is launched, so its Python
work never competes for the GIL with planning.)

Synchronous mode (the ablation):

    planner  [plan N][launch N][wait N ......][apply N][wait output N][plan N+1] ...
    device            [..... step N .....]                                  [ step N+1 ...
    output                                     [detok N, stops N]

Requests that finish by EOS, a stop id or a stop string at step N may also be
in step N+1 (overlap); their extra token is dropped when step N+1 is applied.
Every exception in the planner, device or output thread ends here in
``_fail``, which wakes every waiting caller with ``EngineDeadError``.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from asyncbatch.config import EngineConfig
from asyncbatch.engine.gil_tuning import hold_switch_interval, release_switch_interval
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request, RequestStatus
from asyncbatch.engine.scheduler import Scheduler, StepPlan
from asyncbatch.engine.step_metadata import StepMeta, StepMetadataWriter
from asyncbatch.errors import EngineDeadError
from asyncbatch.executors.base import Executor, StepHandle
from asyncbatch.frontend.output_processor import OutputBatch, OutputProcessor, RequestUpdate  # layering: in-process output thread, until the core runs in its own process
from asyncbatch.profiling.marks import mark, step_begin, step_end
from asyncbatch.profiling.timeline import StepRecord, Timeline


@dataclass(slots=True)
class _InFlight:
    plan: StepPlan
    meta: StepMeta
    handle: StepHandle
    record: StepRecord
    nvtx: object = None  # the step's NVTX range, closed once its results are applied


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, scheduler: Scheduler, max_blocks_per_seq: int,
                 eos_token_id: int | None, hidden_token_ids: frozenset[int]) -> None:
        self.config = config
        self.executor = executor
        self.scheduler = scheduler
        self.eos_token_id = eos_token_id
        self.writer = StepMetadataWriter(config.max_num_seqs, max_blocks_per_seq, config.block_size)
        self.staging = StagingPair(config.max_num_batched_tokens, config.max_num_seqs, max_blocks_per_seq,
                              pinned=getattr(executor, "is_cuda", False))
        self.timeline = Timeline()
        self.output = OutputProcessor(self._on_stop_string, self._fail, hidden_token_ids,
                                      on_request_error=lambda request: self._inbox.put(("error", request)))
        self._max_in_flight = 2 if config.overlap else 1
        self._in_flight: deque[_InFlight] = deque()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}  # planner-owned: live requests by id
        self._handles: dict[str, object] = {}  # every caller-visible handle not yet known finished
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._gc_pause = 0.0
        self._thread = threading.Thread(target=self._run, name="asyncbatch-planner", daemon=True)
        gc.callbacks.append(self._gc_callback)
        self._switch_interval_held = config.switch_interval_s is not None
        if self._switch_interval_held:
            hold_switch_interval(config.switch_interval_s)
        self._thread.start()

    # -- callers (any thread) ------------------------------------------------
    def submit(self, request: Request) -> None:
        with self._lock:
            if self._error is not None:
                raise EngineDeadError("the engine has failed; create a new LLM") from self._error
            if self._closed:
                raise EngineDeadError("the engine is closed")
            if len(self._handles) > 4096:
                self._handles = {k: h for k, h in self._handles.items() if not h.finished}
            existing = self._handles.get(request.request_id)
            if existing is not None and not existing.finished:
                raise ValueError(f"request_id {request.request_id!r} is already in use by a live request")
            self._handles[request.request_id] = request.handle
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def close(self) -> None:
        with self._lock:
            already = self._closed
            self._closed = True
        if not already:
            self._inbox.put(("close",))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self.executor.close()
        self.output.close()
        if self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)
        if self._switch_interval_held:
            self._switch_interval_held = False
            release_switch_interval(self.config.switch_interval_s)
        self._fail_handles(EngineDeadError("the engine was closed before the request finished"))

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- failure -------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._fail_handles(EngineDeadError(f"engine failed: {error!r}"), cause=error)
        self._inbox.put(("fail",))

    def _fail_handles(self, error: BaseException, cause: BaseException | None = None) -> None:
        with self._lock:
            handles = list(self._handles.values())
        if cause is not None:
            error.__cause__ = cause
        for handle in handles:
            handle.fail(error)

    def _on_stop_string(self, request: Request, matched: str) -> None:
        self._inbox.put(("stop", request, matched))

    def _gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif threading.current_thread() is self._thread:
            self._gc_pause += time.perf_counter() - getattr(self, "_gc_started", time.perf_counter())

    # -- the planner loop ----------------------------------------------------
    def _run(self) -> None:
        # Overlap mode hands step N's outputs to the output thread only after step N+2 is launched:
        # the output thread's Python work then competes for the GIL with nothing on the launch path.
        held: OutputBatch | None = None
        try:
            while True:
                idle = not self._in_flight and not self.scheduler.has_work()
                if idle and held is not None:
                    self.output.put(held)
                    held = None
                if not self._drain_inbox(block=idle):
                    break
                plan = None
                if self.scheduler.has_work() and len(self._in_flight) < self._max_in_flight:
                    plan = self._plan_and_launch()
                if held is not None:
                    self.output.put(held)
                    held = None
                if self._in_flight and (plan is None or len(self._in_flight) >= self._max_in_flight):
                    held = self._complete_oldest()
                elif plan is None and not self._in_flight and self.scheduler.has_work():
                    raise RuntimeError(
                        f"scheduler stalled: {len(self.scheduler.waiting)} waiting, nothing runnable "
                        f"({self.scheduler.blocks.num_free_blocks} free KV blocks)")
        except BaseException as exc:  # noqa: BLE001 - every caller must hear about it
            self._fail(exc)

    def _drain_inbox(self, block: bool) -> bool:
        items = [self._inbox.get()] if block else []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            kind = item[0]
            if kind == "add":
                request = item[1]
                self._requests[request.request_id] = request
                self.scheduler.add(request)
            elif kind == "abort":
                request = self._requests.get(item[1])
                if request is not None:
                    self._finish(request, "abort")
                    self.output.put(OutputBatch([RequestUpdate(request, [], "abort")]))
            elif kind == "stop":
                self._finish(item[1], "stop", item[2])
            elif kind == "error":
                self._finish(item[1], "error")
            elif kind in ("close", "fail"):
                return False
        return True

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(request, reason, stop_reason)
        self._requests.pop(request.request_id, None)

    def _plan_and_launch(self) -> StepPlan | None:
        start = time.perf_counter()
        gc_before = self._gc_pause
        with mark("schedule"):
            plan = self.scheduler.schedule()
        if plan is None:
            return None
        nvtx = step_begin(plan.step_id, plan.num_decode, len(plan.rows) - plan.num_decode, plan.num_tokens)
        record = self.timeline.new_record(plan.step_id)
        record.plan_start, record.schedule_end = start, time.perf_counter()
        staging = self.staging.next_buffer()
        record.fence_start = record.schedule_end
        with mark("wait_staging_fence", plan.step_id):
            staging.fence.wait()
        record.fence_end = time.perf_counter()
        staging.fence.arm()
        with mark("prepare_metadata", plan.step_id):
            meta = self.writer.write(plan, staging)
        self.scheduler.release_drained(plan)
        now = time.perf_counter()
        record.plan_end = now
        for row in plan.rows[plan.num_decode:]:
            metrics = row.request.handle.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        with mark("launch", plan.step_id):
            handle = self.executor.launch(meta)
        record.launch_end = time.perf_counter()
        record.num_tokens, record.num_decode = plan.num_tokens, plan.num_decode
        record.num_prefill, record.num_sampled = len(plan.rows) - plan.num_decode, meta.num_sampled
        self._in_flight.append(_InFlight(plan, meta, handle, record, nvtx))
        record.gc_ms = (self._gc_pause - gc_before) * 1e3
        if self.config.debug_check_integrity:
            self.scheduler.check_integrity()
        return plan

    def _complete_oldest(self) -> OutputBatch | None:
        """Wait for the oldest step and apply it; returns its outputs for the caller to hand over
        (overlap mode), or hands them over and waits for them (synchronous mode, returns None)."""
        step = self._in_flight.popleft()
        record = step.record
        record.wait_start = time.perf_counter()
        with mark("wait_step", step.plan.step_id):
            result = self.executor.wait(step.handle)
        record.wait_end = time.perf_counter()
        record.device_start, record.device_end = result.device_start, result.device_end
        record.h2d_ms, record.forward_ms = result.h2d_ms, result.forward_ms
        record.sample_ms, record.d2h_ms = result.sample_ms, result.d2h_ms
        with mark("apply", step.plan.step_id):
            updates = self._apply(step.plan, result)
        step_end(step.nvtx)
        record.apply_end = time.perf_counter()
        if self.config.debug_check_integrity:
            self.scheduler.check_integrity()
        if self._max_in_flight > 1:
            return OutputBatch(updates, record)
        batch = OutputBatch(updates, record, threading.Event())
        self.output.put(batch)
        batch.processed.wait()
        return None

    def _apply(self, plan: StepPlan, result) -> list[RequestUpdate]:
        """Append step N's tokens; finish on EOS, stop ids, max_tokens or non-finite logits."""
        updates: list[RequestUpdate] = []
        tokens = result.token_ids.tolist()
        finite = result.finite.tolist()
        eos = self.eos_token_id
        i = 0
        for row in plan.rows:
            if not row.samples:
                continue
            request = row.request
            token, ok = tokens[i], finite[i]
            i += 1
            request.num_pending -= 1
            if request.status is RequestStatus.FINISHED:
                continue  # sampled after its finish was seen: dropped, never emitted
            if not ok:
                message = "the model produced NaN or infinite logits for this request"
                self._finish(request, "error")
                updates.append(RequestUpdate(request, [], "error", None, message))
                continue
            request.output_token_ids.append(token)
            params = request.params
            reason, stop_reason = None, None
            if token == eos and not params.ignore_eos:
                reason = "stop"
            elif params.stop_token_ids and token in params.stop_token_ids:
                reason, stop_reason = "stop", token
            elif len(request.output_token_ids) >= params.max_tokens:
                reason = "length"
            if reason is not None:
                self._finish(request, reason, stop_reason)
            updates.append(RequestUpdate(request, [token], reason, stop_reason))
        return updates
