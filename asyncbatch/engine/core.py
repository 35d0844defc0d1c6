"""The planner loop: schedule, stage, launch, apply; one step ahead of the device in overlap mode.

It runs on the planner thread of the engine core (in the core process, or in
the caller's process with ``engine_process=False``) and talks to the frontend
only through messages (``engine.messages``): requests and aborts come in, one
columnar ``StepOutputs`` per applied step goes out.

Overlap mode (``overlap_loop``): step N+1 is launched before step N is waited for.

    planner   [plan+launch N+1][send N-1][release...][wait N][apply N][fill N+1][plan+launch N+2][send N][release.][wait N+1]
    device    [...... step N .......................][........ step N+1 ..............................][.. step N+2 ..
    frontend                                                                                  [detok N, stops N]

From the end of step N to the launch of step N+2 the planner is on the
device's critical path (N+2 must be queued before N+1 ends), so only what
N+2 needs happens there: N's tokens applied, N+1's grammar masks filled, N+2
planned. Sending N's outputs (the sender thread pickles them, holding the GIL)
waits until N+2 is launched; any other message to the frontend sends the held
outputs first, so the frontend sees messages in the order they were made.

``release`` (after a launch and the send, while step N runs): the blocks N+1's
prefill chunks fill become cached and N+1's drained requests give back their
rows (``Scheduler.release_drained``); then earlier releases' parked blocks are
registered and freed (``settle_released``) in pieces of a few blocks, only
while step N still runs and within ``SETTLE_STEP_SHARE`` of a step's device
time: the slice looks at N before every piece, so that it fills the planner's
wait for N instead of delaying N's apply (a wave of finishing requests parks
more than a step's slack can settle; the rest waits for later slack, for a plan
that needs the blocks, or for the engine to idle).

Synchronous mode (``sync_loop``, the ablation): plan N, launch N, wait N, apply
N, send N, wait for the frontend's ``StepAck`` of N, then plan N+1.

A request that finishes by EOS, a stop id or a stop string at step N may also
be in step N+1 (overlap); ``Scheduler.apply`` drops that extra token. Every
exception here reaches the frontend as ``CoreFailed``, which fails every
waiting caller with ``EngineDeadError``.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from asyncbatch.config import EngineConfig
from asyncbatch.engine.control import Call
from asyncbatch.engine.core_control import ControlHandler
from asyncbatch.engine.gil_tuning import hold_switch_interval, release_switch_interval
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.live_requests import GrammarCompiled, LiveRequests
from asyncbatch.engine.logprob_columns import prompt_columns, sampled_columns
from asyncbatch.engine.messages import (
    AbortRequests,
    AddRequests,
    CoreFailed,
    Finish,
    FinishRequests,
    Shutdown,
    StepAck,
    StepOutputs,
    ended_only,
)
from asyncbatch.engine.planner_warmup import PlannerWarmup, warm_up_planner
from asyncbatch.engine.scheduler import SETTLE_STEP_SHARE, Scheduler, StepPlan
from asyncbatch.engine.step_contract import GrammarMask
from asyncbatch.engine.step_extras import StepExtrasWriter
from asyncbatch.engine.step_metadata import StepMeta, StepMetadataWriter
from asyncbatch.engine.structured_state import GrammarState
from asyncbatch.executors.base import Executor, StepHandle
from asyncbatch.executors.kernel_threads import one_kernel_thread_here
from asyncbatch.profiling.marks import mark, step_begin, step_end
from asyncbatch.profiling.timeline import StepRecord, stage
from asyncbatch.sampling.token_bitmask import bitmask_words

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    """A launched step: what was planned, what was staged, and how to wait for it."""

    plan: StepPlan
    meta: StepMeta
    handle: StepHandle
    record: StepRecord
    nvtx: object = None  # the step's NVTX range, closed once its results are applied


def planner_writer(scheduler: Scheduler, vocab_size: int) -> StepMetadataWriter:
    """The metadata writer of ``scheduler``'s planner (``EngineCore`` builds its own with this, and the planner
    warm-up its throwaway one): extras (bias, grammar masks, logprobs) where the engine has a vocabulary."""
    spec = scheduler.speculative
    extras = StepExtrasWriter(scheduler.rows, scheduler.eos_token_id, bitmask_words(vocab_size),
                              1 if spec is None else 1 + spec.num_speculative_tokens,
                              spec is not None and spec.uses_draft_model) if vocab_size else None
    return StepMetadataWriter(scheduler.rows, scheduler.blocks, extras, speculative=spec is not None)


class EngineCore:
    """Owns the scheduler, the staging buffers and the executor; only the planner thread touches them.

    ``send`` delivers a message to the frontend (a pipe to the caller's process, or a queue in-process).
    Messages for the core go to ``inbox`` from any thread.
    """

    def __init__(self, config: EngineConfig, executor: Executor, scheduler: Scheduler, max_blocks_per_seq: int,
                 send: Callable[[object], None], vocab_size: int = 0,
                 make_grammar_compiler: Callable[[], object] | None = None) -> None:
        self.config = config
        self.executor = executor
        self.scheduler = scheduler
        self._vocab_size = vocab_size
        self.writer = planner_writer(scheduler, vocab_size)
        self.planner_warmup: PlannerWarmup | None = None  # what the warm-up ran (``config.planner_warmup``)
        extras = self.writer.extras
        # Grammar rows need a compiler (a tokenizer); ``allowed_token_ids`` / ``bad_words`` rows only the masks.
        self.grammar = (GrammarState(make_grammar_compiler, scheduler.eos_token_id, vocab_size)
                        if extras is not None else None)
        self._unfilled: list[GrammarMask] = []  # launched masks not yet filled (released if the planner dies)
        self.staging = StagingPair(config.max_num_batched_tokens, config.max_num_seqs, max_blocks_per_seq,
                                   pinned=getattr(executor, "is_cuda", False))
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_now = send
        self._held: StepOutputs | None = None  # a finished step's outputs, sent once the next step is launched
        self._live = LiveRequests(scheduler, self.grammar, self._send, self.inbox,
                                   strict=self.config.debug_check_integrity)
        self._acked = 0  # synchronous mode: the newest step the frontend has processed
        self.last_launched_step = 0  # the newest launched step's id (``LastLaunchedStep``)
        self._idle = False  # the planner blocked for lack of work since the last launched step
        self._last_step_s = 0.0  # device time of the newest applied step (a release slice takes a share)
        self._gc_pause = 0.0
        self._gc_started = 0.0
        self.control = ControlHandler(self, self._send)  # answers the frontend's control calls between two steps
        self._thread = threading.Thread(target=self._run, name="asyncbatch-planner", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._gc_callback)
        if self.config.switch_interval_s is not None:
            # The planner, the device thread and the sender hand the GIL to each other several times a step;
            # at CPython's 5 ms a thread that wants it back may wait a whole step. ``LLM`` holds this for an
            # in-process core; here it also covers the engine core's own process, where nothing else did.
            hold_switch_interval(self.config.switch_interval_s)
        if self.config.structured_outputs_warmup and self.grammar is not None and self.grammar.can_compile:
            self.grammar.warm_up()
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_live_requests(self) -> int:
        """Requests added and not ended yet (``NumLiveRequests``)."""
        return len(self._live)

    # -- the loops -------------------------------------------------------------
    def _run(self) -> None:
        if self.executor.name == "cpu":
            one_kernel_thread_here()  # the device thread's kernel pool stays the only one (``kernel_threads``)
        try:
            if self.config.planner_warmup:  # on this thread: the heap it grows is the planner's
                self._warm_up_planner()
            if self.config.overlap:
                self.overlap_loop()
            else:
                self.sync_loop()
        except BaseException as exc:  # noqa: BLE001 - every caller must hear about it
            self._send(CoreFailed(repr(exc), traceback.format_exc()))
        finally:
            for mask in self._unfilled:  # a device thread may wait on one: let it finish its step
                mask.set_ready(time.perf_counter())
            if self.grammar is not None:
                self.grammar.close()
            if self._gc_callback in gc.callbacks:
                gc.callbacks.remove(self._gc_callback)
            if self.config.switch_interval_s is not None:
                release_switch_interval(self.config.switch_interval_s)
            self.executor.close()

    def _warm_up_planner(self) -> None:
        """``planner_warmup``: rehearse admissions on throwaway planner objects before serving. It reads and writes
        nothing of this engine's, so if it fails the engine serves without it (the failure is logged)."""
        try:
            self.planner_warmup = warm_up_planner(
                self.config.block_size, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                self.config.enable_prefix_caching, partial(planner_writer, vocab_size=self._vocab_size),
                self.scheduler.eos_token_id)
        except Exception:  # a rehearsal: the engine's own planner is untouched
            logger.warning("engine core: the planner warm-up failed; serving without it", exc_info=True)

    def overlap_loop(self) -> None:
        """Launch N+1, then finish N: the device always has the next step queued behind the current one.

        Step N+1's grammar masks are filled right after N is applied (``_finish_step``), while N+1's forward
        runs; with ``grammar_mask_overlap=False`` (the naive way) N is finished before N+1 is launched
        whenever a grammar request is live. N+1's release (``_release``: its drained requests, its prefill
        blocks' registration) waits until then when N+1 has masks to fill: the sampling of N+1 waits on
        them, and releasing a step's drained requests can take longer than a step (256 at once: ~2 ms).
        """
        last: InFlight | None = None
        while self._serve_inbox(block=last is None and not self.scheduler.has_work()):
            if last is not None and self._masks_before_launch():
                self._finish_step(last)
                last = None
            current = self._launch_next(in_flight=last is not None)
            self._flush_held()
            release_after = last is not None and current is not None and self._fills_after(current)
            if current is not None and not release_after:
                self._release(current, awaited=last if last is not None else current)
            if last is not None:
                self._finish_step(last, fill=current, hold=current is not None)
            elif current is None:
                self._check_not_stalled()
            if release_after:
                self._release(current, awaited=current)
            last = current
        if last is not None:
            self._finish_step(last)
        self._flush_held()

    def _fills_after(self, step: InFlight) -> bool:
        """Whether ``step``'s grammar masks wait for the step before it to be applied (``_fill_launched``)."""
        return step.meta.extras is not None and step.meta.extras.grammar in self._unfilled

    def _masks_before_launch(self) -> bool:
        return not self.config.grammar_mask_overlap and self.grammar is not None and self.grammar.active

    def sync_loop(self) -> None:
        """Plan, launch, wait, apply, and wait for the frontend before planning again."""
        while self._serve_inbox(block=not self.scheduler.has_work()):
            step = self._launch_next()
            if step is None:
                self._check_not_stalled()
                continue
            self._release(step, awaited=step)
            self._finish_step(step)
            if not self._await_ack(step.plan.step_id):
                return

    # -- one step ----------------------------------------------------------------
    def _launch_next(self, in_flight: bool = False) -> InFlight | None:
        """Plan, stage and launch the next step (None: nothing to run). ``in_flight``: an earlier step is not
        applied yet, so this step's grammar masks are filled by ``_finish_step`` of that step, while this one
        runs; otherwise they are filled before the launch."""
        record = StepRecord(self.scheduler.next_step_id)
        gc_before = self._gc_pause
        with stage(record, "plan_start", "schedule_end", "schedule"):
            plan = self.scheduler.schedule()
        if plan is None:
            return None
        nvtx = step_begin(plan.step_id, plan.num_decode, plan.num_prefill, plan.num_tokens)
        staging = self.staging.next_buffer()
        with stage(record, "fence_start", "fence_end", "wait_staging_fence"):
            staging.fence.wait()
        staging.fence.arm()
        with stage(record, None, "plan_end", "prepare_metadata"):
            meta = self.writer.write(plan, staging)
        if self.config.debug_check_integrity:
            self.writer.check_decode_tables(meta)
        mask = meta.extras.grammar if meta.extras is not None else None
        if mask is not None:
            if in_flight or mask.device_drafts:  # filled while it runs (its drafts: ``GrammarMask.device_drafts``)
                self._unfilled.append(mask)
            else:
                self._fill(mask, record)
        with stage(record, None, "launch_end", "launch"):
            handle = self.executor.launch(meta)
            if mask is not None and not in_flight and not mask.device_drafts:
                self.executor.masks_ready(handle)
        record.num_tokens, record.num_decode = plan.num_tokens, plan.num_decode
        record.num_prefill, record.num_sampled = plan.num_prefill, meta.num_sampled
        record.num_admitted, record.admit_ms = plan.num_admitted, plan.admit_s * 1e3
        record.admit_cpu_ms = plan.admit_cpu_s * 1e3
        record.gc_ms = (self._gc_pause - gc_before) * 1e3
        scheduler = self.scheduler
        record.num_running, record.num_waiting = len(scheduler.running), len(scheduler.waiting)
        blocks = scheduler.blocks
        record.kv_blocks_usable = blocks.num_usable_blocks
        record.kv_blocks_used = record.kv_blocks_usable - blocks.num_free_blocks
        record.after_idle, self._idle = self._idle, False
        self.last_launched_step = plan.step_id
        launched = InFlight(plan, meta, handle, record, nvtx)
        if mask is not None and not in_flight and mask.device_drafts:
            self._fill_launched(launched)
        return launched

    def _release(self, launched: InFlight, awaited: InFlight) -> None:
        """What ``launched``'s plan leaves to do once it runs, off the launch path: register the blocks its
        prefill chunks fill and release its drained requests (all of it: the next plan needs both), then settle
        parked releases (``settle_released``) while ``awaited`` (the step the planner waits for next) runs, for
        at most ``SETTLE_STEP_SHARE`` of the last step's device time. Timed in ``launched``'s record."""
        record, scheduler, executor = launched.record, self.scheduler, self.executor
        record.settle_start = time.perf_counter()
        with mark("release", launched.plan.step_id):
            scheduler.release_drained(launched.plan)
            if scheduler.num_parked_releases:
                handle = awaited.handle
                scheduler.settle_released(SETTLE_STEP_SHARE * self._last_step_s,
                                          stop=lambda: executor.is_done(handle))
        record.settle_ms = (time.perf_counter() - record.settle_start) * 1e3
        if self.config.debug_check_integrity:
            scheduler.check_integrity()

    def _fill(self, mask: GrammarMask, record: StepRecord, handle: StepHandle | None = None) -> None:
        """Fill a step's grammar masks: every earlier step is applied (and, with ``mask.device_drafts``, the
        step, ``handle``, is launched: its drafts come from the device)."""
        executor = self.executor
        gone = None if handle is None else (lambda: executor.is_done(handle))
        with mark("grammar_mask_fill", record.step_id):
            record.mask_fill_ms, record.mask_fill_cpu_ms, record.drafts_wait_ms = self.grammar.fill(mask, gone)
        record.grammar_rows = len(mask.index)

    def _fill_launched(self, step: InFlight) -> None:
        """Fill the masks of ``step``, launched while the step before it was in flight, and let its sampling
        run. Here on the planner, not on a worker thread: measured on 2 cores, the hand-off to a worker cost
        more than running the planner's next steps beside the fill saved (profiles/structured-output-sim-*)."""
        mask = step.meta.extras.grammar
        self._fill(mask, step.record, step.handle)
        self._unfilled.remove(mask)
        self.executor.masks_ready(step.handle)

    def _finish_step(self, step: InFlight, fill: InFlight | None = None, hold: bool = False) -> None:
        """Wait for ``step``'s tokens, apply them (grammar matchers too), fill ``fill``'s grammar masks if it
        has any, and send the frontend the step's outputs (``hold``: keep them until ``_flush_held``, after
        the next launch)."""
        record = step.record
        with stage(record, "wait_start", "wait_end", "wait_step"):
            result = self.executor.wait(step.handle)
        record.device_start, record.device_end = result.device_start, result.device_end
        self._last_step_s = max(result.device_end - result.device_start, 0.0)
        record.h2d_ms, record.forward_ms = result.h2d_ms, result.forward_ms
        record.sample_ms, record.d2h_ms = result.sample_ms, result.d2h_ms
        record.mask_wait_ms, record.mask_wait_start = result.mask_wait_ms, result.mask_wait_start
        apply_cpu = time.thread_time()
        with stage(record, None, "apply_end", "apply"):
            if result.num_emitted is None:
                applied = self.scheduler.apply(step.plan, result.token_ids, result.finite)
            else:
                applied = self.scheduler.apply_verified(step.plan, result.token_ids, result.num_emitted, result.finite)
                record.spec_drafts, record.spec_draft_tokens, record.spec_accepted_tokens = result.spec_counts
                record.reconcile_ms = self.scheduler.applier.reconcile_s * 1e3
            ended = np.asarray(applied.errored, dtype=np.int64)
            ended_codes = np.full(len(ended), Finish.ERROR, dtype=np.int8)
            applied, ended, ended_codes = self._live.advance_grammars(applied, ended, ended_codes)
            for seq in applied.seqs[applied.finish != Finish.NONE].tolist() + ended.tolist():
                self._live.forget(seq)
            if result.grammar_drafts is not None:  # what the grammar rows' next verify checks
                self.grammar.note_drafts(step.meta.extras.grammar.seqs, result.grammar_drafts,
                                         result.grammar_num_drafts)
        record.apply_cpu_ms = (time.thread_time() - apply_cpu) * 1e3
        if fill is not None and self._fills_after(fill):
            self._fill_launched(fill)
        step_end(step.nvtx)
        if self.config.debug_check_integrity:
            self.scheduler.check_integrity()
        extras = step.meta.extras
        width = result.token_ids.shape[1] if result.token_ids.ndim == 2 else 1  # positions a decode row computed
        first_seqs, first_cached = step.plan.first_scheduled()
        outputs = StepOutputs(
            step.plan.step_id, applied.seqs, applied.token_ids, applied.finish, ended, ended_codes, first_seqs,
            record, sampled_columns(extras, result.logprobs, applied, step.plan.num_decode, width),
            prompt_columns(extras, result.prompt_logprobs), applied.num_tokens,
            first_cached if first_cached.any() else None)
        if hold:
            self._held = outputs
        else:
            self._send(outputs)

    def _send(self, message: object) -> None:
        """Every message to the frontend goes through here: held step outputs first, so order is kept."""
        self._flush_held()
        self._send_now(message)

    def _flush_held(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._send_now(held)

    def _check_not_stalled(self) -> None:
        if self.scheduler.has_work():  # nothing runs, so nothing will free blocks or bring tokens back
            raise RuntimeError(
                f"scheduler stalled: {len(self.scheduler.waiting)} waiting, nothing runnable "
                f"({self.scheduler.blocks.num_free_blocks} free KV blocks)")

    # -- messages ------------------------------------------------------------------
    def _serve_inbox(self, block: bool) -> bool:
        """Handle every waiting message (waiting for one if ``block``); False once told to stop."""
        try:
            if block:
                self._idle = True
                self.scheduler.settle_released()  # nothing stays parked while the engine sleeps
                message = self.inbox.get()
            else:
                message = self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._handle(message):
                return False
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _await_ack(self, step_id: int) -> bool:
        while self._acked < step_id:
            if not self._handle(self.inbox.get()):
                return False
        return True

    def _handle(self, message: object) -> bool:
        with mark("inbox"):
            if isinstance(message, AddRequests):
                self._live.admit(message.requests)
            elif isinstance(message, GrammarCompiled):
                self._live.compiled(message)
            elif isinstance(message, AbortRequests):
                ended = [seq for seq in message.seqs if self._live.end(seq, Finish.ABORT)]
                if ended:
                    self._send(ended_only(ended, Finish.ABORT))
            elif isinstance(message, FinishRequests):
                for seq, code in zip(message.seqs, message.codes):
                    self._live.end(seq, code)
            elif isinstance(message, StepAck):
                self._acked = max(self._acked, message.step_id)
            elif isinstance(message, Call):
                self.control.handle(message)
            elif isinstance(message, Shutdown):
                return False
            else:
                raise TypeError(f"unexpected message for the engine core: {message!r}")
        return True

    def _gc_callback(self, phase: str, info: dict) -> None:
        if threading.current_thread() is not self._thread:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_pause += time.perf_counter() - self._gc_started
