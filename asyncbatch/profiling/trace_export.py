"""Chrome trace JSON of the step timeline, for Perfetto (ui.perfetto.dev) and chrome://tracing.

One process per run, with these tracks (threads):

    planner   [plan N+1: schedule|fence|prepare_metadata|launch] [wait_step N] [apply N] ...
    device    [step N: h2d|forward|sample]            [step N+1 ...]     (cpu/sim: inside the step)
    idle      .....................[planning][launch].                   (one slice per gap piece, by cause)
    output                           [output N]
    h2d, d2h  [h2d N+1]              [d2h N]                              (cuda only: copies outside the step)

Slice names are the NVTX stage names (``profiling.marks``) so the trace and an
Nsight Systems session read alike; every slice carries ``step`` in its args,
and a flow arrow joins each launch to its device step. Times are the
timeline's ``perf_counter`` seconds, rebased so each run starts at 0, or moved
onto a torch.profiler trace's clock when one is merged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from asyncbatch.profiling.gap_report import CAUSES, GapReport, attribute_gaps, h2d_precedes_device_start
from asyncbatch.profiling.timeline import StepRecord, Timeline

_TRACKS = {"planner": 1, "device": 2, "idle": 3, "output": 4, "h2d": 5, "d2h": 6}
_TRACK_LABELS = {"planner": "planner (engine core)", "device": "device", "idle": "device idle (by cause)",
                 "output": "frontend output processing (caller's process)", "h2d": "H2D copies", "d2h": "D2H copies"}
_PID_BASE = 900_000_000  # above any OS pid, so a merged torch.profiler trace keeps its own processes


@dataclass
class TraceRun:
    """One run to export: completed step records and what they were measured on."""

    records: list[StepRecord]
    backend: str = "unknown"
    mode: str = ""
    simulated: bool = False
    lifetimes: list[tuple[float, float]] | None = None  # request (arrival, finished), for "queue empty"
    report: GapReport | None = None  # computed from the above when None

    def __post_init__(self) -> None:
        self.records = [r for r in self.records if r.device_end > 0]
        if self.report is None:
            self.report = attribute_gaps(self.records, self.lifetimes, h2d_precedes_device_start(self.backend))

    @property
    def label(self) -> str:
        sim = " (simulated)" if self.simulated else ""
        return " ".join(x for x in ("asyncbatch", self.mode, "on", self.backend) if x) + sim


def as_run(source, lifetimes: Iterable[tuple[float, float]] | None = None) -> TraceRun:
    """A ``TraceRun`` from an ``LLM`` (its current window), a ``Timeline``, a list of records, or a ``TraceRun``."""
    if isinstance(source, TraceRun):
        return source
    spans = list(lifetimes) if lifetimes is not None else None
    if isinstance(source, Timeline):
        return TraceRun(source.window(), lifetimes=spans)
    if hasattr(source, "timeline") and hasattr(source, "config"):  # an LLM
        return TraceRun(source.timeline.window(), source.device, "overlap" if source.config.overlap else "sync",
                        bool(getattr(source, "simulated", False)), spans)
    return TraceRun(list(source), lifetimes=spans)


def _slice(name: str, start: float, end: float, pid: int, track: str, origin: float, **args: object) -> dict:
    # Whole nanoseconds, written as microseconds: a boundary two slices share becomes the same integer in the
    # viewer (Perfetto rounds ts*1000), so slices that touch never appear to overlap or mis-nest.
    ts_ns, end_ns = round((start - origin) * 1e9), round((end - origin) * 1e9)
    return {"name": name, "ph": "X", "pid": pid, "tid": _TRACKS[track], "ts": ts_ns / 1000,
            "dur": max(end_ns - ts_ns, 0) / 1000, "args": args}


def _valid(start: float, end: float) -> bool:
    return start > 0 and end >= start


def _planner(r: StepRecord, pid: int, o: float) -> list[dict]:
    step = r.step_id
    out = []
    if _valid(r.plan_start, r.launch_end):
        out.append(_slice(f"plan {step}", r.plan_start, r.launch_end, pid, "planner", o, step=step,
                          tokens=r.num_tokens, decode=r.num_decode, prefill=r.num_prefill, gc_ms=r.gc_ms))
        for name, s, e in (("schedule", r.plan_start, r.schedule_end), ("wait_staging_fence", r.fence_start, r.fence_end),
                           ("prepare_metadata", r.fence_end, r.plan_end), ("launch", r.plan_end, r.launch_end)):
            if _valid(s, e):
                out.append(_slice(name, s, e, pid, "planner", o, step=step))
        # A flow arrow from the launch call to the step on the device (both ends inside their slices).
        flow = {"name": "launch", "cat": "step", "id": (pid - _PID_BASE) * 10_000_000 + step, "pid": pid}
        out.append({**flow, "ph": "s", "tid": _TRACKS["planner"],
                    "ts": round((0.5 * (r.plan_end + r.launch_end) - o) * 1e6, 3)})
        out.append({**flow, "ph": "f", "bp": "e", "tid": _TRACKS["device"],
                    "ts": round((0.5 * (r.device_start + r.device_end) - o) * 1e6, 3)})
    if _valid(r.wait_start, r.wait_end):
        out.append(_slice("wait_step", r.wait_start, r.wait_end, pid, "planner", o, step=step))
    if _valid(r.wait_end, r.apply_end):
        out.append(_slice("apply", r.wait_end, r.apply_end, pid, "planner", o, step=step,
                          accepted=r.spec_accepted_tokens))
        if r.reconcile_ms > 0:  # the one-step-late part of a speculative step's apply, at its start
            out.append(_slice("reconcile", r.wait_end, min(r.wait_end + r.reconcile_ms * 1e-3, r.apply_end), pid,
                              "planner", o, step=step))
    if _valid(r.output_start, r.output_end):
        out.append(_slice("output", r.output_start, r.output_end, pid, "output", o, step=step,
                          tokens=r.output_tokens))
    return out


def _device(r: StepRecord, pid: int, o: float, backend: str) -> list[dict]:
    step, start, end = r.step_id, r.device_start, r.device_end
    kind = "prefill" if r.num_decode == 0 else ("decode" if r.num_prefill == 0 else "mixed")
    out = [_slice(f"step {step}", start, end, pid, "device", o, step=step, kind=kind, tokens=r.num_tokens,
                  decode=r.num_decode, prefill=r.num_prefill, sampled=r.num_sampled, h2d_ms=r.h2d_ms,
                  forward_ms=r.forward_ms, sample_ms=r.sample_ms, d2h_ms=r.d2h_ms)]
    h2d, fwd, smp, d2h = r.h2d_ms * 1e-3, r.forward_ms * 1e-3, r.sample_ms * 1e-3, r.d2h_ms * 1e-3
    if h2d_precedes_device_start(backend):
        # Only durations are recorded for the copies: H2D is drawn ending at the step's start (exact when the
        # device waited for it, early otherwise), D2H starting at its end.
        forwarded = min(start + fwd, end)
        stages = [("forward", start, forwarded), ("sample", forwarded, min(forwarded + smp, end))]
        out.append(_slice("h2d", start - h2d, start, pid, "h2d", o, step=step))
        out.append(_slice("d2h", end, end + d2h, pid, "d2h", o, step=step))
    elif backend == "cpu":  # the device thread copies in, runs, samples, then copies out
        copied, forwarded = min(start + h2d, end), min(start + h2d + fwd, end)
        stages = [("h2d", start, copied), ("forward", copied, forwarded), ("sample", forwarded, end)]
        out.append(_slice("d2h", end, end + d2h, pid, "device", o, step=step))
    else:  # sim: the modelled step is all "forward"; its copy happens on the thread, off the modelled clock
        stages = [("forward", start, end)]
    out += [_slice(name, s, e, pid, "device", o, step=step) for name, s, e in stages if e > s]
    return out


def _idle(run: TraceRun, pid: int, o: float) -> list[dict]:
    out = []
    for gap in run.report.gaps:
        for s, e, cause in gap.pieces:
            out.append(_slice(cause, s, e, pid, "idle", o, label=CAUSES[cause], after_step=gap.step_before,
                              gap_ms=round(gap.gap_ms, 6)))
    for r in run.records:  # the waits for grammar masks inside steps
        if r.mask_wait_ms > 0:
            out.append(_slice("grammar_mask", r.mask_wait_start, r.mask_wait_start + r.mask_wait_ms * 1e-3, pid,
                              "idle", o, label=CAUSES["grammar_mask"], step=r.step_id,
                              gap_ms=round(r.mask_wait_ms, 6)))
    return out


def _metadata(run: TraceRun, pid: int, order: int) -> list[dict]:
    out = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": run.label}},
           {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": order}}]
    copies = h2d_precedes_device_start(run.backend)
    for track, tid in _TRACKS.items():
        if track in ("h2d", "d2h") and not copies:
            continue
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": _TRACK_LABELS[track]}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return out


def _run_events(run: TraceRun, pid: int, order: int, origin: float | None) -> list[dict]:
    if not run.records:
        return _metadata(run, pid, order)
    o = origin if origin is not None else min(r.plan_start or r.device_start for r in run.records)
    events = _metadata(run, pid, order)
    for r in run.records:
        events += _planner(r, pid, o)
        events += _device(r, pid, o, run.backend)
    events += _idle(run, pid, o)
    return events


def _torch_origin(torch_trace: dict) -> float:
    """The perf_counter second that is ``ts = 0`` on a torch.profiler trace's clock.

    torch.profiler writes ``ts`` in microseconds after ``baseTimeNanoseconds``
    on the wall clock; ``time.time() - time.perf_counter()`` moves the
    timeline's clock there (good to a fraction of a millisecond).
    """
    wall_minus_perf = time.time() - time.perf_counter()
    return torch_trace.get("baseTimeNanoseconds", 0) * 1e-9 - wall_minus_perf


def _write(path: str | Path, events: list[dict], other: dict, merged: dict | None) -> dict:
    trace: dict = {"displayTimeUnit": "ms", "otherData": other}
    if merged is not None:
        events = merged.get("traceEvents", []) + events
        trace.update({k: v for k, v in merged.items() if k != "traceEvents"})
        trace["otherData"] = {**merged.get("otherData", {}), **other}
    trace["traceEvents"] = events
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")))
    return trace


def export_trace(source, path: str | Path, torch_trace: str | Path | None = None,
                 lifetimes: Iterable[tuple[float, float]] | None = None) -> dict:
    """Write the timeline of an ``LLM`` (or a ``Timeline``, or a list of ``StepRecord``) as Chrome trace JSON.

    ``torch_trace``: a file from ``torch.profiler``'s ``export_chrome_trace``
    recorded during the same run; its events are merged and ours are moved
    onto its clock. ``lifetimes``: request ``(arrival, finished)`` times, so
    idle pieces can be attributed to an empty queue. Returns the trace dict.
    """
    return export_traces({"run": source}, path, torch_trace, {"run": lifetimes} if lifetimes else None)


def export_traces(sources: Mapping[str, object], path: str | Path, torch_trace: str | Path | None = None,
                  lifetimes: Mapping[str, Iterable[tuple[float, float]]] | None = None) -> dict:
    """Several runs in one trace, one process each, each starting at 0 (side by side), unless merged with torch."""
    merged = json.loads(Path(torch_trace).read_text()) if torch_trace is not None else None  # read once
    origin = _torch_origin(merged) if merged is not None else None
    events: list[dict] = []
    other: dict = {"generator": "asyncbatch.profiling.trace_export", "clock": "perf_counter", "runs": {}}
    for i, (name, source) in enumerate(sources.items()):
        run = as_run(source, (lifetimes or {}).get(name))
        events += _run_events(run, _PID_BASE + i, i, origin)
        other["runs"][name] = {"label": run.label, "backend": run.backend, "mode": run.mode,
                               "simulated": run.simulated, "steps": len(run.records),
                               "gap_report": run.report.to_dict()}
    return _write(path, events, other, merged)


def _slices(trace: dict, track: str, prefix: str, pid: int | None) -> dict[int, tuple[float, float]]:
    out = {}
    for e in trace["traceEvents"]:
        if (e.get("ph") == "X" and e.get("tid") == _TRACKS[track] and e["name"].startswith(prefix)
                and (pid is None or e["pid"] == pid)):
            out[e["args"]["step"]] = (e["ts"], e["ts"] + e["dur"])
    return out


def device_slices(trace: dict, pid: int | None = None) -> dict[int, tuple[float, float]]:
    """``{step: (ts, end)}`` of the device track's step slices, in trace microseconds (tests, scripts)."""
    return _slices(trace, "device", "step ", pid)


def planner_slices(trace: dict, pid: int | None = None) -> dict[int, tuple[float, float]]:
    """``{step: (ts, end)}`` of the planner's ``plan N`` slices (schedule through launch)."""
    return _slices(trace, "planner", "plan ", pid)


def run_pids(trace: dict) -> dict[str, int]:
    """Process ids of the runs in a trace written by ``export_traces``, by run name."""
    return {name: _PID_BASE + i for i, name in enumerate(trace["otherData"]["runs"])}

