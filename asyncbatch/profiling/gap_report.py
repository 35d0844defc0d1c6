"""Idle-gap attribution: why the device sat idle between two steps.

An idle gap is ``[device_end N, device_start N+1]`` for consecutive completed
steps (sorted by device start; overlapping steps leave no gap). The gap is cut
at every boundary of the host intervals the timeline recorded, and each piece
goes to the first cause in priority order whose intervals cover it:

    device   [ step N ]░░░░░░░░░░░░░░░░░░░░░░░░░░░░[ step N+1 ]
    planner     [wait N ]··[apply N]·······[plan N+1]·
    output                       [out N]
    pieces             result apply  output wakeup planning launch

One idle time lies inside a step rather than between two: a step with grammar
rows whose forward finished before the host filled its masks waits there
(``StepRecord.mask_wait_ms``); it counts as idle, cause ``grammar_mask``, and not
as busy time.

Priority: ``queue_empty``, ``staging_fence``, ``h2d`` (``cuda`` only), ``planning``
(less its ``gc`` share), ``release``, ``reconcile`` (the start of a speculative
step's apply), ``apply``, ``d2h``, ``output``, ``result``; what no interval
covers is ``wakeup`` before step N+1's planning began, ``launch`` after. ``CAUSES``
names and labels them; reports, traces and tests read those names.

Beside the causes, the idle time is split by the kind of step it delayed
(``STEP_KINDS``, ``GapReport.kinds``): a step that admits requests, one planned
right after requests left the batch (finished, aborted, drained or preempted),
and the rest (steady decode). A run's whole busy fraction mixes the three in
proportion to their step counts; the split shows, for instance, that a
speculative run's fewer, fuller steps spend the same burst and finishing-wave
idle over fewer steps, while its steady steps are as busy as a plain run's.

The report also carries ``admission_us_per_request``: the
planner's time per admitted request in the steps that admitted any, the
cost behind the "planning" gaps of an admission burst; and ``speculative``:
vLLM's speculative decoding counters over the same steps, the tokens the
device emitted per step and the reconciliation's milliseconds per step
(``timeline.speculative_counts``; all zero without speculation).

Invariant: for every gap, the causes sum to the gap exactly (up to float
rounding), because every piece gets exactly one cause and the remainder takes
what nothing else claims.

Specification (the intervals each cause reads, an example): docs/gap-report.md
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from asyncbatch.profiling.timeline import StepRecord, admission_us_per_request, speculative_counts

CAUSES: dict[str, str] = {
    "queue_empty": "queue empty",
    "staging_fence": "waiting for the staging fence",
    "h2d": "H2D copy",
    "planning": "planning (schedule, metadata, launch)",
    "gc": "Python GC pauses",
    "release": "registering blocks and releasing requests (after a launch)",
    "reconcile": "reconciling speculative upper bounds (one step late)",
    "apply": "applying results",
    "d2h": "D2H copy",
    "output": "output processing",
    "result": "waiting for the step's result after device end",
    "wakeup": "wake-up/hand-off latency before planning",
    "launch": "launch latency (launched, not yet started)",
    "grammar_mask": "inside a step: sampling waited for the host's grammar masks",
}

# The kind of a step, which the idle time before it (and its own grammar-mask wait) is counted under. A step
# is ``admitting`` if its plan admitted waiting requests, else ``finishing`` if fewer requests were running
# after its plan than after the previous one's (requests left the batch in between: their releases, the
# decode set rebuilt, its metadata rewritten), else ``steady``. The first step of a report has no gap
# before it; its own grammar wait still counts under its kind.
STEP_KINDS: dict[str, str] = {
    "admitting": "admitting requests",
    "finishing": "after requests left",
    "steady": "steady (the rest)",
}
_ORDER = ("queue_empty", "staging_fence", "h2d", "planning", "release", "reconcile", "apply", "d2h",
          "output")  # "gc" splits "planning"

# Backends whose recorded device start comes after the step's H2D copy.
_H2D_BEFORE_START = frozenset({"cuda"})


def h2d_precedes_device_start(backend: str) -> bool:
    """Whether a step's H2D copy lies before its ``device_start`` (and so may be idle time)."""
    return backend in _H2D_BEFORE_START


@dataclass(slots=True)
class GapAttribution:
    """One idle gap and its pieces; ``causes_ms`` sums to ``(end - start)`` in ms."""

    step_before: int
    step_after: int
    start: float  # perf_counter seconds: device_end of step_before
    end: float  # device_start of step_after
    pieces: list[tuple[float, float, str]]  # (start, end, cause), in time order, adjacent same causes merged
    causes_ms: dict[str, float]

    @property
    def gap_ms(self) -> float:
        return (self.end - self.start) * 1e3

    @property
    def dominant(self) -> str:
        return max(self.causes_ms, key=self.causes_ms.__getitem__)


@dataclass(slots=True)
class StepKindShare:
    """The steps of one ``STEP_KINDS`` kind in a report: how many, their device time and the idle time before
    them (their grammar-mask waits included)."""

    steps: int = 0
    busy_ms: float = 0.0
    idle_ms: float = 0.0

    @property
    def busy_fraction(self) -> float:
        total = self.busy_ms + self.idle_ms
        return self.busy_ms / total if total > 0 else 1.0


@dataclass(slots=True)
class GapReport:
    """Busy fraction, idle time and its causes over a run of completed steps."""

    steps: int
    span_ms: float  # first device start to last device end
    busy_ms: float
    idle_ms: float  # sum of the gaps and of the grammar-mask waits; equals sum(causes_ms.values())
    causes_ms: dict[str, float]
    queue_measured: bool  # False: no request lifetimes were given, "queue_empty" is 0 by construction
    gaps: list[GapAttribution] = field(default_factory=list)
    # Planner microseconds per request admitted in these steps (``StepRecord.admit_ms``): the host cost behind
    # the "planning" gaps of an admission burst (0.0 when no step admitted a request).
    admission_us_per_request: float = 0.0
    # vLLM's speculative decoding counters over these steps, emitted tokens and reconcile ms per step
    # (``timeline.speculative_counts``).
    speculative: dict = field(default_factory=dict)
    # ``STEP_KINDS`` name -> that kind's steps, their busy ms and the idle ms counted under them.
    kinds: dict[str, StepKindShare] = field(default_factory=dict)
    # ``admission_us_per_request`` in the planner thread's CPU time (``StepRecord.admit_cpu_ms``): the wall figure
    # less what the machine's other threads and processes took from the planner meanwhile.
    admission_cpu_us_per_request: float = 0.0

    @property
    def busy_fraction(self) -> float:
        return self.busy_ms / self.span_ms if self.span_ms > 0 else 1.0

    @property
    def idle_ms_per_step(self) -> float:
        """Mean gap between consecutive steps (``summarize``'s ``idle_gap_ms_mean``)."""
        return self.idle_ms / (self.steps - 1) if self.steps > 1 else 0.0

    def shares(self) -> dict[str, float]:
        """Fraction of the idle time per cause (all zero when there was no idle time)."""
        return {k: (v / self.idle_ms if self.idle_ms > 0 else 0.0) for k, v in self.causes_ms.items()}

    def kind_busy_fraction(self, kind: str) -> float:
        """Busy fraction of the steps of one ``STEP_KINDS`` kind, with the idle time counted under them."""
        share = self.kinds.get(kind)
        return share.busy_fraction if share is not None else 1.0

    def to_dict(self, with_gaps: bool = False) -> dict:
        out = {"steps": self.steps, "span_ms": self.span_ms, "busy_ms": self.busy_ms, "idle_ms": self.idle_ms,
               "device_busy_fraction": self.busy_fraction, "idle_ms_per_step": self.idle_ms_per_step,
               "causes_ms": dict(self.causes_ms), "cause_shares": self.shares(),
               "cause_labels": dict(CAUSES), "queue_measured": self.queue_measured,
               "admission_us_per_request": self.admission_us_per_request,
               "admission_cpu_us_per_request": self.admission_cpu_us_per_request, "speculative": dict(self.speculative),
               "step_kinds": {k: {"steps": v.steps, "busy_ms": v.busy_ms, "idle_ms": v.idle_ms,
                                  "busy_fraction": v.busy_fraction} for k, v in self.kinds.items()}}
        if with_gaps:
            out["gaps"] = [{"after_step": g.step_before, "before_step": g.step_after, "gap_ms": g.gap_ms,
                            "causes_ms": g.causes_ms} for g in self.gaps]
        return out


class _Intervals:
    """Disjoint sorted intervals of one cause, each with a payload (the GC fraction for planning)."""

    __slots__ = ("ends", "payloads", "starts")

    def __init__(self, items: Iterable[tuple[float, float, float]]) -> None:
        merged: list[list[float]] = []
        for s, e, p in sorted(i for i in items if i[1] > i[0]):
            if merged and s < merged[-1][1]:  # overlap (not mere touching): one interval, larger payload
                last = merged[-1]
                last[1], last[2] = max(last[1], e), max(last[2], p)
            else:
                merged.append([s, e, p])
        self.starts = [m[0] for m in merged]
        self.ends = [m[1] for m in merged]
        self.payloads = [m[2] for m in merged]

    def covering(self, t: float) -> int:
        """Index of the interval containing ``t``, or -1."""
        i = bisect.bisect_right(self.starts, t) - 1
        return i if i >= 0 and t < self.ends[i] else -1

    def boundaries(self, a: float, b: float) -> Iterable[float]:
        """Starts and ends of the intervals that intersect ``(a, b)``."""
        i = max(bisect.bisect_right(self.ends, a), 0)
        while i < len(self.starts) and self.starts[i] < b:
            yield self.starts[i]
            yield self.ends[i]
            i += 1


def _valid(start: float, end: float) -> bool:
    return start > 0 and end > start  # 0.0 means "not recorded" in a StepRecord


def _host_intervals(records: Sequence[StepRecord], h2d_before_start: bool) -> dict[str, _Intervals]:
    raw: dict[str, list[tuple[float, float, float]]] = {k: [] for k in _ORDER if k != "queue_empty"}
    for r in records:
        planning = [(r.plan_start, r.fence_start), (r.fence_end, r.launch_end)]
        planned_s = sum(e - s for s, e in planning if _valid(s, e))
        gc_fraction = min(r.gc_ms * 1e-3 / planned_s, 1.0) if planned_s > 0 else 0.0
        raw["planning"] += [(s, e, gc_fraction) for s, e in planning if _valid(s, e)]
        pairs = {"staging_fence": (r.fence_start, r.fence_end), "apply": (r.wait_end, r.apply_end),
                 "reconcile": (r.wait_end, min(r.wait_end + r.reconcile_ms * 1e-3, r.apply_end)),
                 "release": (r.settle_start or r.launch_end, (r.settle_start or r.launch_end) + r.settle_ms * 1e-3),
                 "d2h": (r.device_end, r.device_end + r.d2h_ms * 1e-3),
                 "output": (r.output_start, r.output_end)}
        if h2d_before_start:
            pairs["h2d"] = (r.device_start - r.h2d_ms * 1e-3, r.device_start)
        for cause, (s, e) in pairs.items():
            if _valid(s, e):
                raw[cause].append((s, e, 0.0))
    return {k: _Intervals(v) for k, v in raw.items()}


def _queue_empty(lifetimes: Iterable[tuple[float, float]]) -> _Intervals:
    """The complement of the union of request lifetimes, from -inf to +inf."""
    live = _Intervals((s, e, 0.0) for s, e in lifetimes)
    edges = [float("-inf")]
    for s, e in zip(live.starts, live.ends):
        edges += [s, e]
    edges.append(float("inf"))
    return _Intervals((edges[i], edges[i + 1], 0.0) for i in range(0, len(edges), 2))


def attribute_gaps(records: Sequence[StepRecord], lifetimes: Iterable[tuple[float, float]] | None = None,
                   h2d_before_start: bool = False) -> GapReport:
    """Attribute every idle gap between consecutive completed steps to the causes in ``CAUSES``.

    ``lifetimes``: ``(arrival_time, finished_time)`` of every request that was
    live during the records (perf_counter seconds, as in ``RequestMetrics``);
    without them, queue-empty time is not detected and lands in the remainder.
    """
    done = sorted((r for r in records if _valid(r.device_start, r.device_end)), key=lambda r: r.device_start)
    causes = dict.fromkeys(CAUSES, 0.0)
    spans = list(lifetimes) if lifetimes is not None else []
    if not done:
        return GapReport(0, 0.0, 0.0, 0.0, causes, bool(spans), kinds={k: StepKindShare() for k in STEP_KINDS})
    index = _host_intervals(records, h2d_before_start)
    if spans:  # no lifetimes at all means "not measured", not "the queue was always empty"
        index["queue_empty"] = _queue_empty(spans)
    order = [(k, index[k]) for k in _ORDER if k in index]
    gaps = []
    kinds = {k: StepKindShare() for k in STEP_KINDS}
    kind_of = [step_kind(r, done[i - 1] if i else None) for i, r in enumerate(done)]  # [i]: done[i]'s kind
    for r, kind in zip(done, kind_of):
        share = kinds[kind]
        share.steps += 1
        share.busy_ms += r.busy_s * 1e3
        share.idle_ms += r.mask_wait_ms
    for (before, after), kind in zip(itertools.pairwise(done), kind_of[1:]):
        a, b = before.device_end, after.device_start
        if b <= a:
            continue
        extra = []
        if before.wait_end > a and (after.plan_start <= 0 or before.wait_end <= after.plan_start):
            extra.append(("result", _Intervals([(a, before.wait_end, 0.0)])))
        gap = _attribute_one(a, b, order + extra, after.plan_start)
        gap.step_before, gap.step_after = before.step_id, after.step_id
        gaps.append(gap)
        kinds[kind].idle_ms += gap.gap_ms
        for k, v in gap.causes_ms.items():
            causes[k] += v
    mask_wait = sum(r.mask_wait_ms for r in done)
    causes["grammar_mask"] += mask_wait
    busy = sum(r.busy_s for r in done) * 1e3
    span = (max(r.device_end for r in done) - done[0].device_start) * 1e3
    idle = sum(g.gap_ms for g in gaps) + mask_wait
    return GapReport(len(done), span, busy, idle, causes, bool(spans), gaps, admission_us_per_request(done),
                     speculative_counts(done), kinds, admission_us_per_request(done, cpu=True))


def step_kind(record: StepRecord, previous: StepRecord | None) -> str:
    """``record``'s ``STEP_KINDS`` kind; ``previous``: the step launched before it (None for a report's first)."""
    if record.num_admitted:
        return "admitting"
    if previous is not None and record.num_running < previous.num_running:
        return "finishing"
    return "steady"


def _attribute_one(a: float, b: float, order: list[tuple[str, _Intervals]], next_plan_start: float
                   ) -> GapAttribution:
    cuts = {a, b}
    for _, intervals in order:
        cuts.update(t for t in intervals.boundaries(a, b) if a < t < b)
    edges = sorted(cuts)
    causes = dict.fromkeys(CAUSES, 0.0)
    pieces: list[tuple[float, float, str]] = []
    for lo, hi in itertools.pairwise(edges):
        mid = 0.5 * (lo + hi)
        cause, gc_fraction = ("wakeup" if mid < next_plan_start else "launch"), 0.0
        for name, intervals in order:
            i = intervals.covering(mid)
            if i >= 0:
                cause, gc_fraction = name, intervals.payloads[i]
                break
        length_ms = (hi - lo) * 1e3
        if cause == "planning" and gc_fraction > 0:
            causes["gc"] += gc_fraction * length_ms
            length_ms -= gc_fraction * length_ms
        causes[cause] += length_ms
        if pieces and pieces[-1][2] == cause:
            pieces[-1] = (pieces[-1][0], hi, cause)
        else:
            pieces.append((lo, hi, cause))
    return GapAttribution(-1, -1, a, b, pieces, causes)


def gap_report(llm, lifetimes: Iterable[tuple[float, float]] | None = None) -> GapReport:
    """The gap report of an ``LLM``'s current timeline window (see ``LLM.reset_stats``)."""
    return attribute_gaps(llm.timeline.window(), lifetimes, h2d_precedes_device_start(llm.device))


def lifetimes_of(outputs: Iterable) -> list[tuple[float, float]]:
    """``(arrival_time, finished_time)`` of finished ``RequestOutput``s, for ``queue_empty``."""
    spans = []
    for out in outputs:
        m = out.metrics
        if m is not None and m.finished_time is not None:
            spans.append((m.arrival_time, m.finished_time))
    return spans
