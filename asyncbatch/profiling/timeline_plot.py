"""A PNG of a window of the step timeline: one panel per run, the same steps in each.

Rows of a panel, top to bottom:

    planner   schedule | fence | prepare_metadata | launch, wait_step (grey), apply
    device    steps (alternating greys); idle gaps filled with their cause's colour
    output    output processing per step

Draws on matplotlib's Agg canvas directly (no pyplot, no display, no global
backend switch). Times are milliseconds from
the window's first device start, so panels of different runs line up at 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from asyncbatch.profiling.gap_report import CAUSES, GapReport
from asyncbatch.profiling.timeline import StepRecord

CAUSE_COLORS = {
    "queue_empty": "#bbbbbb", "staging_fence": "#d62728", "h2d": "#8c564b", "planning": "#1f77b4",
    "gc": "#e377c2", "release": "#aec7e8", "reconcile": "#98df8a", "apply": "#2ca02c", "d2h": "#bcbd22", "output": "#9467bd", "result": "#8dd3c7", "wakeup": "#ff7f0e",
    "launch": "#17becf", "grammar_mask": "#fdd835",
}
_PLANNER_STAGES = (("schedule", "plan_start", "schedule_end", "#1f77b4"),
                   ("wait_staging_fence", "fence_start", "fence_end", "#d62728"),
                   ("prepare_metadata", "fence_end", "plan_end", "#6baed6"),
                   ("launch", "plan_end", "launch_end", "#08306b"),
                   ("wait_step", "wait_start", "wait_end", "#e0e0e0"),
                   ("apply", "wait_end", "apply_end", "#2ca02c"))
_ROWS = {"planner": 2.0, "device": 1.0, "output": 0.0}


def default_window(records: Sequence[StepRecord], num_steps: int) -> int:
    """First step index of a steady-state window: after the last prefill if that leaves room, else 0."""
    done = sorted((r for r in records if r.device_end > 0), key=lambda r: r.device_start)
    last_prefill = max((i for i, r in enumerate(done) if r.num_prefill), default=-1)
    start = last_prefill + 1
    return start if start + num_steps <= len(done) else max(0, min(len(done) - num_steps, len(done) // 3))


def _bars(ax, row: str, spans: list[tuple[float, float]], colors, height: float = 0.7, edge: bool = True,
          **kwargs) -> None:
    # An edge in the bar's own colour keeps sub-pixel bars (a 0.1 ms gap in a 2 s window) visible.
    if spans:
        ax.broken_barh(spans, (_ROWS[row] - height / 2, height), facecolors=colors,
                       edgecolors=colors if edge else "none", linewidth=0.8 if edge else 0, **kwargs)


def _panel(ax, label: str, records: Sequence[StepRecord], report: GapReport, first: int, num_steps: int) -> None:
    done = sorted((r for r in records if r.device_end > 0), key=lambda r: r.device_start)
    window = done[first:first + num_steps]
    if not window:
        ax.set_title(f"{label}: no steps")
        return
    t0, t1 = window[0].device_start, window[-1].device_end

    def span(s: float, e: float) -> tuple[float, float] | None:
        s, e = max(s, t0), min(e, t1)
        return ((s - t0) * 1e3, (e - s) * 1e3) if s > 0 and e > s else None

    for name, start_field, end_field, color in _PLANNER_STAGES:
        spans = [x for r in done if (x := span(getattr(r, start_field), getattr(r, end_field)))]
        _bars(ax, "planner", spans, color, label=name)
    steps = [span(r.device_start, r.device_end) for r in window]
    _bars(ax, "device", steps, ["#4d4d4d" if i % 2 else "#7f7f7f" for i in range(len(steps))], edge=False)
    idle_ms = dict.fromkeys(CAUSES, 0.0)
    for gap in report.gaps:
        for s, e, cause in gap.pieces:
            if (x := span(s, e)) is not None:
                _bars(ax, "device", [x], CAUSE_COLORS[cause])
                idle_ms[cause] += x[1]
    waits = [x for r in window if r.mask_wait_ms > 0
             and (x := span(r.mask_wait_start, r.mask_wait_start + r.mask_wait_ms * 1e-3))]
    _bars(ax, "device", waits, CAUSE_COLORS["grammar_mask"])  # inside a step: not busy
    idle_ms["grammar_mask"] += sum(x[1] for x in waits)
    outputs = [x for r in done if (x := span(r.output_start, r.output_end))]
    _bars(ax, "output", outputs, "#9467bd")
    busy = sum(x[1] for x in steps) - sum(x[1] for x in waits)
    total = (t1 - t0) * 1e3
    idle = total - busy
    ax.set_title(f"{label}: steps {window[0].step_id}-{window[-1].step_id}, device busy {100 * busy / total:.1f}%, "
                 f"idle {idle / max(len(window) - 1, 1):.3f} ms/step", fontsize=9, loc="left")
    ax.set_yticks(list(_ROWS.values()), list(_ROWS.keys()))
    ax.set_ylim(-0.6, 2.6)
    ax.set_xlim(0, total)
    ax.grid(axis="x", alpha=0.3)


def plot_timeline(runs: Mapping[str, tuple[Sequence[StepRecord], GapReport]], path: str | Path,
                  first_step: int | None = None, num_steps: int = 16, title: str = "") -> Path:
    """Write a PNG with one panel per run over the same step indices; returns the path.

    ``first_step`` is an index into each run's completed steps; by default the
    first run's steady-state window (``default_window``) is used for every run.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(14, 2.4 * len(runs) + 1.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(runs), 1, squeeze=False)
    if first_step is None:
        first_step = default_window(next(iter(runs.values()))[0], num_steps) if runs else 0
    for ax, (label, (records, report)) in zip(axes[:, 0], runs.items()):
        _panel(ax, label, records, report, first_step, num_steps)
    axes[-1, 0].set_xlabel("ms from the window's first device start")
    handles = [Patch(color=c, label=n) for n, _, _, c in _PLANNER_STAGES]
    handles += [Patch(color="#9467bd", label="output processing"), Patch(color="#7f7f7f", label="device step")]
    handles += [Patch(color=CAUSE_COLORS[k], label=f"idle: {v}") for k, v in CAUSES.items()]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.12 if len(runs) > 1 else 0.2, 1, 0.93 if title else 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
