"""The step timeline: what each thread and the device did for every step.

Always on: one ``StepRecord`` per step, filled by the planner (planning,
fence wait, launch, waiting, applying results), by the executor's result
(device start/end and per-stage times) and by the output thread. All times are
``time.perf_counter`` seconds, the clock the ``cpu`` and ``sim`` devices read
and onto which CUDA event times are mapped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from asyncbatch.profiling.marks import mark


@dataclass(slots=True)
class StepRecord:
    step_id: int
    num_tokens: int = 0
    num_decode: int = 0
    num_prefill: int = 0
    num_sampled: int = 0
    plan_start: float = 0.0  # planner: schedule + write metadata
    schedule_end: float = 0.0
    fence_start: float = 0.0  # planner waits for the staging buffer's fence
    fence_end: float = 0.0
    plan_end: float = 0.0  # metadata written
    launch_end: float = 0.0  # launch call returned
    device_start: float = 0.0
    device_end: float = 0.0
    h2d_ms: float = 0.0
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    d2h_ms: float = 0.0
    wait_start: float = 0.0  # planner waits for this step's tokens
    wait_end: float = 0.0
    apply_end: float = 0.0  # planner applied the tokens (appends, EOS/stop ids, frees)
    # The planner thread's CPU time in that apply: wall time beyond it was spent waiting (for the GIL, mostly).
    apply_cpu_ms: float = 0.0
    output_start: float = 0.0  # output thread: detokenize, stop strings, stream
    output_end: float = 0.0
    detok_ms: float = 0.0  # of the output thread's time, rows with detokenizer work (0: no text this step)
    output_tokens: int = 0  # tokens accepted for callers (extra tokens after a finish excluded)
    num_admitted: int = 0  # waiting requests the step admitted
    admit_ms: float = 0.0  # planner time admitting them (``StepPlan.admit_s``)
    admit_cpu_ms: float = 0.0  # the planner thread's CPU time in it (``StepPlan.admit_cpu_s``)
    gc_ms: float = 0.0  # Python GC pauses that overlapped the planner's work on this step
    # After the launch (and the send of held outputs), while the step before it ran: registering blocks,
    # releasing requests (``EngineCore._release``); 0.0: not recorded (then it began at ``launch_end``).
    settle_start: float = 0.0
    settle_ms: float = 0.0
    # Structured outputs: the device idled inside the step, its forward done, until the host filled the
    # step's grammar masks (``mask_wait_*``; not busy time, the gap report's ``grammar_mask``);
    # ``mask_fill_ms`` is the host's time filling them for ``grammar_rows`` rows, ``mask_fill_cpu_ms`` the
    # planner thread's CPU time in it (the grammar library's work; wall well above it: the planner was off
    # the CPU or waited for the GIL).
    mask_wait_ms: float = 0.0
    mask_wait_start: float = 0.0
    mask_fill_ms: float = 0.0
    mask_fill_cpu_ms: float = 0.0
    grammar_rows: int = 0
    # A draft model's verify step with grammar rows: the planner's wait, inside the fill, for the drafts the
    # device makes at the start of the step (``GrammarMask.device_drafts``); not in ``mask_fill_ms``. It
    # delays the planning of the next step, not this one.
    drafts_wait_ms: float = 0.0
    # Speculative decoding (vLLM's counters): rows that verified drafts, draft tokens, and drafts accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # The planner's time reconciling its upper bounds with what the step really emitted (the one-step-late
    # part of a verify step's apply; ``StepApplier._reconcile``): from ``wait_end``, inside ``apply_end``.
    reconcile_ms: float = 0.0
    # The engine's load when the step was planned (the server's gauges read them from the newest record).
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_usable: int = 0
    # The planner had nothing to do before this step (it blocked waiting for requests), so the device gap
    # before it is a lack of work, not host overhead: the cumulative busy counters leave that gap out.
    after_idle: bool = False

    @property
    def busy_s(self) -> float:
        """Device busy time: start to end, less the wait for grammar masks inside the step."""
        return self.device_end - self.device_start - self.mask_wait_ms * 1e-3

    @property
    def planner_ms(self) -> float:
        return ((self.fence_start - self.plan_start) + (self.launch_end - self.fence_end)) * 1e3


class stage:
    """Time one stage of a step into ``record`` (``start``/``end`` field names) under an NVTX range ``name``.

    A class rather than a generator-based context manager: it runs five times per step on the launch path.
    """

    __slots__ = ("end", "name", "range", "record", "start")

    def __init__(self, record: StepRecord, start: str | None, end: str, name: str) -> None:
        self.record, self.start, self.end, self.name = record, start, end, name

    def __enter__(self) -> None:
        if self.start is not None:
            setattr(self.record, self.start, time.perf_counter())
        self.range = mark(self.name, self.record.step_id)
        self.range.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.range.__exit__(*exc)
        setattr(self.record, self.end, time.perf_counter())


@dataclass
class Timeline:
    """The frontend's record of every step, in the order their outputs were processed.

    ``wait_for_step`` waits for the record of a given step (the frontend passes the newest launched
    step, which only the engine core knows: ``LLM.wait_settled``).

    A long-running engine (a server) would grow ``records`` without end, so past ``max_records`` the
    oldest quarter is dropped (the measurement window shrinks with it). ``busy_s_total`` and
    ``span_s_total`` count over every step ever added, for rates between two scrapes: the device's
    busy time, and the wall time from each step's start (or the previous step's end, when the planner
    was not idle waiting for requests in between) to its end, so ``delta busy / delta span`` is the
    busy fraction while there was work.
    """

    records: list[StepRecord] = field(default_factory=list)
    max_records: int = 200_000
    busy_s_total: float = 0.0
    span_s_total: float = 0.0
    # Speculative decoding since the start, for counters that outlive dropped records: rows that verified
    # drafts, draft tokens, accepted tokens.
    spec_totals: list[int] = field(default_factory=lambda: [0, 0, 0])
    # Texts ``LLM.generate`` decoded itself once its outputs were in (``RequestHandle.text_by_caller``): not part
    # of any step's output processing. Counted since the last ``reset``.
    caller_decoded: int = 0
    caller_decode_s: float = 0.0
    _window_start: int = 0
    _last_end: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self.records.append(record)
            if record.spec_drafts:
                totals = self.spec_totals
                totals[0] += record.spec_drafts
                totals[1] += record.spec_draft_tokens
                totals[2] += record.spec_accepted_tokens
            if record.device_end > 0:
                busy = record.busy_s
                self.busy_s_total += busy
                if self._last_end > 0 and not record.after_idle:
                    self.span_s_total += max(record.device_end - self._last_end, busy)
                else:
                    self.span_s_total += record.device_end - record.device_start
                self._last_end = record.device_end
            if len(self.records) > self.max_records:
                drop = len(self.records) // 4
                del self.records[:drop]
                self._window_start = max(self._window_start - drop, 0)

    def recent(self, n: int) -> list[StepRecord]:
        """The newest ``n`` completed steps (oldest first)."""
        with self._lock:
            return [r for r in self.records[-n:] if r.device_end > 0]

    def add_caller_decode(self, texts: int, seconds: float) -> None:
        with self._lock:
            self.caller_decoded += texts
            self.caller_decode_s += seconds

    def reset(self) -> None:
        with self._lock:
            self._window_start = len(self.records)
            self.caller_decoded, self.caller_decode_s = 0, 0.0

    def window(self) -> list[StepRecord]:
        with self._lock:
            return [r for r in self.records[self._window_start:] if r.device_end > 0]

    def stats(self) -> dict:
        """``summarize`` of the window, and the texts ``generate`` decoded after its outputs were in."""
        stats = summarize(self.window())
        stats.update(generate_detok_texts=self.caller_decoded, generate_detok_ms=self.caller_decode_s * 1e3)
        return stats

    def wait_for_step(self, step_id: int, timeout_s: float) -> bool:
        """Wait until step ``step_id`` and every step before it were added (applied and output-processed);
        False if that took longer than ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        while True:
            with self._lock:
                newest = self.records[-1].step_id if self.records else 0
            if newest >= step_id:
                return True
            if time.perf_counter() >= deadline:
                return False
            time.sleep(0.002)


def steady_decode_window(records: list[StepRecord], min_decode: int) -> list[StepRecord]:
    """The contiguous steady-state decode steps: after the last step with a prefill row, while at least
    ``min_decode`` rows decode (so the tail where requests drain away is left out)."""
    last_prefill = max((i for i, r in enumerate(records) if r.num_prefill), default=-1)
    window = []
    for record in records[last_prefill + 1:]:
        if record.num_decode < min_decode:
            break
        window.append(record)
    return window


def admission_us_per_request(records: list[StepRecord], cpu: bool = False) -> float:
    """Planner microseconds per admitted request over ``records`` (0.0 when none admitted any): wall clock, or
    with ``cpu`` the planner thread's CPU time (what the machine's other work did not take from it)."""
    admitted = sum(r.num_admitted for r in records)
    spent = sum(r.admit_cpu_ms if cpu else r.admit_ms for r in records)
    return spent * 1e3 / admitted if admitted else 0.0


def summarize(records: list[StepRecord]) -> dict:
    """Busy fraction, idle gaps and per-stage costs over a list of completed steps."""
    if not records:
        return {"steps": 0, "output_tokens": 0, "device_busy_fraction": 0.0, "idle_gap_ms_mean": 0.0,
                "admission_us_per_request": 0.0, "admission_cpu_us_per_request": 0.0,
                "idle_gap_ms_p99": 0.0, "planner_ms_per_step": 0.0, "span_s": 0.0}
    starts = np.array([r.device_start for r in records])
    ends = np.array([r.device_end for r in records])
    busy = float(sum(r.busy_s for r in records))
    span = float(ends[-1] - starts[0])
    gaps = np.maximum(starts[1:] - ends[:-1], 0.0) * 1e3 if len(records) > 1 else np.zeros(1)
    output_tokens = int(sum(r.output_tokens for r in records))
    return {
        "steps": len(records),
        "output_tokens": output_tokens,
        "span_s": span,
        "device_busy_fraction": busy / span if span > 0 else 1.0,
        "idle_gap_ms_mean": float(gaps.mean()),
        "idle_gap_ms_p50": float(np.percentile(gaps, 50)),
        "idle_gap_ms_p99": float(np.percentile(gaps, 99)),
        "planner_ms_per_step": float(np.mean([r.planner_ms for r in records])),
        "fence_wait_ms_per_step": float(np.mean([(r.fence_end - r.fence_start) * 1e3 for r in records])),
        "apply_ms_per_step": float(np.mean([(r.apply_end - r.wait_end) * 1e3 for r in records])),
        "apply_cpu_ms_per_step": float(np.mean([r.apply_cpu_ms for r in records])),
        "output_ms_per_step": float(np.mean([(r.output_end - r.output_start) * 1e3 for r in records])),
        "detok_ms_per_step": float(np.mean([r.detok_ms for r in records])),
        "settle_ms_per_step": float(np.mean([r.settle_ms for r in records])),
        "admission_us_per_request": admission_us_per_request(records),
        "admission_cpu_us_per_request": admission_us_per_request(records, cpu=True),
        "device_ms_per_step": float((ends - starts).mean() * 1e3),
        "h2d_ms_per_step": float(np.mean([r.h2d_ms for r in records])),
        "sample_ms_per_step": float(np.mean([r.sample_ms for r in records])),
        "tokens_per_step": float(np.mean([r.num_tokens for r in records])),
        "mask_wait_ms_per_step": float(np.mean([r.mask_wait_ms for r in records])),
        "mask_fill_ms_per_step": float(np.mean([r.mask_fill_ms for r in records])),
        "mask_fill_cpu_ms_per_step": float(np.mean([r.mask_fill_cpu_ms for r in records])),
        "mask_fill_us_per_row": _fill_us_per_row(records),
        "drafts_wait_ms_per_step": float(np.mean([r.drafts_wait_ms for r in records])),
        "output_tokens_per_s": output_tokens / span if span > 0 else 0.0,
        **speculative_counts(records),
    }


def speculative_counts(records: list[StepRecord]) -> dict:
    """vLLM's speculative decoding metrics over ``records``: drafts (rows that verified at least one draft),
    draft tokens, accepted tokens, acceptance rate (accepted / draft tokens) and mean acceptance length (tokens
    a draft-verifying row emits per step: 1 + accepted / drafts); and two of asyncbatch's own: the tokens the
    device emitted per step (a token per sampled row, plus the accepted drafts) and the planner's milliseconds
    per step reconciling its upper bounds one step late (``StepRecord.reconcile_ms``)."""
    drafts = sum(r.spec_drafts for r in records)
    draft_tokens = sum(r.spec_draft_tokens for r in records)
    accepted = sum(r.spec_accepted_tokens for r in records)
    steps = len(records)
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "emitted_tokens_per_step": (sum(r.num_sampled for r in records) + accepted) / steps if steps else 0.0,
            "reconcile_ms_per_step": sum(r.reconcile_ms for r in records) / steps if steps else 0.0}


def _fill_us_per_row(records: list[StepRecord]) -> float:
    """Host microseconds per grammar row to fill masks (0 without grammar rows)."""
    rows = sum(r.grammar_rows for r in records)
    return sum(r.mask_fill_ms for r in records) * 1e3 / rows if rows else 0.0
