"""Profiling: NVTX ranges, the Chrome trace, and the idle-gap report.

Runs on the simulated device. Assertions are about structure and accounting
(which slices exist, what overlaps what, that causes sum to the idle time),
never about speed: the machine may be small and busy.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import types

import pytest

from asyncbatch import SamplingParams, SimConfig
from asyncbatch.profiling import marks as timeline_marks
from asyncbatch.profiling.gap_report import CAUSES, STEP_KINDS, attribute_gaps, gap_report, lifetimes_of
from asyncbatch.profiling.marks import count_ranges, enable_nvtx, mark, measure_mark_overhead, nvtx_enabled
from asyncbatch.profiling.timeline import StepRecord, summarize
from asyncbatch.profiling.trace_export import (
    device_slices,
    export_trace,
    export_traces,
    planner_slices,
    run_pids,
)

# Steps long enough that "the planner plans N+1 while the device runs N" survives a busy machine.
SLOW_SIM = SimConfig(step_fixed_ms=20.0, per_token_us=0.0, per_context_token_ns=0.0)
FAST_SIM = SimConfig(step_fixed_ms=0.5, per_token_us=0.0, per_context_token_ns=0.0)


@pytest.fixture(autouse=True)
def nvtx_state(monkeypatch):
    """Every test starts with NVTX off and leaves the module as it found it."""
    for name in ("_nvtx", "_domain", "_enabled", "_messages"):
        monkeypatch.setattr(timeline_marks, name, getattr(timeline_marks, name))
    enable_nvtx(False)


def workload(n: int = 8, max_tokens: int = 10):
    prompts = [[300 + (i * 31 + j) % 5000 for j in range(6 + 3 * i)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens - i % 3, temperature=0.0, ignore_eos=True) for i in range(n)]
    return prompts, params


def run(make_llm, overlap: bool, sim: SimConfig = FAST_SIM, n: int = 8, max_tokens: int = 10,
        engine_process: bool = True):
    llm = make_llm(device="sim", overlap=overlap, sim=sim, engine_process=engine_process)
    prompts, params = workload(n, max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.wait_settled(10.0), "steps never completed"
    return llm, outputs


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def assert_well_nested(trace: dict) -> None:
    """On every track, slices either nest or follow each other (as a viewer reads them: whole ns)."""
    tracks: dict = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            start = round(e["ts"] * 1000)
            tracks.setdefault((e["pid"], e["tid"]), []).append((start, -(start + round(e["dur"] * 1000)), e))
    for slices in tracks.values():
        open_ends: list[int] = []
        for start, neg_end, event in sorted(slices, key=lambda x: x[:2]):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or -neg_end <= open_ends[-1], f"{event['name']} crosses its parent"
            open_ends.append(-neg_end)


# -- acceptance (1): the trace ---------------------------------------------------------------
def test_trace_shows_planning_ahead_only_in_overlap_mode(make_llm, tmp_path):
    with count_ranges() as counter:  # NVTX on (the real package's domain when installed) for both runs
        assert nvtx_enabled()
        overlap, out_a = run(make_llm, True, SLOW_SIM)
        sync, out_b = run(make_llm, False, SLOW_SIM)
    assert [o.token_ids for o in out_a] == [o.token_ids for o in out_b]
    assert counter.stage_ranges > 0
    path = tmp_path / "trace.json"
    export_traces({"overlap": overlap, "sync": sync}, path,
                  lifetimes={"overlap": lifetimes_of(out_a), "sync": lifetimes_of(out_b)})
    trace = json.loads(path.read_text())
    assert trace["otherData"]["runs"]["overlap"]["mode"] == "overlap"
    pids = run_pids(trace)
    for mode, llm in (("overlap", overlap), ("sync", sync)):
        steps = [r.step_id for r in llm.timeline.window()]
        device, planner = device_slices(trace, pids[mode]), planner_slices(trace, pids[mode])
        assert sorted(device) == sorted(steps) == sorted(planner), mode
        assert all(end > start for start, end in device.values()), "every step has a device start and end"
        pairs = [(n, n + 1) for n in steps if n + 1 in planner]
        ahead = [overlaps(planner[m], device[n]) for n, m in pairs]
        assert len(pairs) >= 8
        if mode == "overlap":
            # Structural in a 20 ms step; one miss allowed for a scheduler stall on a busy machine.
            assert sum(ahead) >= len(pairs) - 1, ahead
        else:
            assert not any(ahead), "synchronous mode never plans while the device runs"
    assert_well_nested(trace)
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    assert {"process_name", "thread_name"} <= names


def test_export_trace_merges_a_torch_profiler_trace(make_llm, tmp_path):
    torch = pytest.importorskip("torch")
    llm = make_llm(device="sim", overlap=True, sim=FAST_SIM)
    prompts, params = workload(4, 6)
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
          torch.profiler.record_function("probe_generate")):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.wait_settled(10.0), "steps never completed"
    torch_path = tmp_path / "torch.json"
    prof.export_chrome_trace(str(torch_path))
    trace = export_trace(llm, tmp_path / "merged.json", torch_trace=torch_path)
    probe = next(e for e in trace["traceEvents"] if e.get("name") == "probe_generate")
    device = device_slices(json.loads((tmp_path / "merged.json").read_text()))
    assert len(device) == len(llm.timeline.window())
    slack_us = 2000.0  # the two clocks are matched through time.time(): well under a millisecond apart
    assert probe["ts"] - slack_us <= min(s for s, _ in device.values())
    assert max(e for _, e in device.values()) <= probe["ts"] + probe["dur"] + slack_us


# -- acceptance (2): causes add up ------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_causes_sum_to_measured_idle_time(make_llm, overlap):
    llm, outputs = run(make_llm, overlap, n=12, max_tokens=16)
    report = gap_report(llm, lifetimes_of(outputs))
    stats = summarize(llm.timeline.window())
    measured_idle_ms = stats["idle_gap_ms_mean"] * (stats["steps"] - 1)
    assert report.steps == stats["steps"]
    assert report.busy_fraction == pytest.approx(stats["device_busy_fraction"], rel=1e-9)
    assert report.idle_ms == pytest.approx(measured_idle_ms, rel=1e-9, abs=1e-9)
    assert sum(report.causes_ms.values()) == pytest.approx(measured_idle_ms, rel=0.05, abs=1e-6)
    for gap in report.gaps:  # exact per gap, and pieces tile the gap in order
        assert sum(gap.causes_ms.values()) == pytest.approx(gap.gap_ms, rel=1e-9, abs=1e-9)
        assert gap.pieces[0][0] == gap.start and gap.pieces[-1][1] == gap.end
        assert all(p[1] == q[0] for p, q in zip(gap.pieces, gap.pieces[1:]))
    assert set(report.causes_ms) == set(CAUSES)
    assert sum(k.idle_ms for k in report.kinds.values()) == pytest.approx(report.idle_ms, rel=1e-9, abs=1e-9)
    assert sum(k.steps for k in report.kinds.values()) == report.steps
    assert report.kinds["admitting"].steps >= 1  # the first plan admits
    if not overlap:
        assert report.idle_ms > 0 and report.causes_ms["planning"] > 0


def record(step: int, **times_ms: float) -> StepRecord:
    r = StepRecord(step)
    for name, value in times_ms.items():
        setattr(r, name, value if name.endswith("_ms") else value * 1e-3)
    return r


def test_attribution_follows_the_documented_priority():
    # Synchronous-looking gap from 10 to 20 ms (times in ms; 0 means "not recorded").
    before = record(0, plan_start=1, schedule_end=2, fence_start=2, fence_end=2, plan_end=3, launch_end=3,
                    device_start=4, device_end=10, wait_start=5, wait_end=11, apply_end=12,
                    output_start=12.5, output_end=14)
    after = record(1, plan_start=15, schedule_end=15.5, fence_start=15.5, fence_end=16, plan_end=17, launch_end=18,
                   device_start=20, device_end=25, gc_ms=1.0)
    report = attribute_gaps([before, after], lifetimes=[(0.0, 0.0128), (0.0132, 1.0)])
    c = report.causes_ms
    assert c["result"] == pytest.approx(1.0)  # 10-11: waiting for step 0's tokens
    assert c["apply"] == pytest.approx(1.0)  # 11-12
    assert c["queue_empty"] == pytest.approx(0.4)  # 12.8-13.2, inside output processing, ranks first
    assert c["output"] == pytest.approx(1.1)  # 12.5-14 less the empty queue
    assert c["wakeup"] == pytest.approx(1.5)  # 12-12.5 and 14-15: hand-offs before planning
    assert c["staging_fence"] == pytest.approx(0.5)  # 15.5-16
    assert c["gc"] == pytest.approx(1.0)  # 1 ms of GC over 2.5 ms of planning
    assert c["planning"] == pytest.approx(1.5)
    assert c["launch"] == pytest.approx(2.0)  # 18-20: launched, not started
    assert sum(c.values()) == pytest.approx(10.0) == report.idle_ms
    assert report.gaps[0].dominant == "launch"
    causes = [p[2] for p in report.gaps[0].pieces]
    assert causes == ["result", "apply", "wakeup", "output", "queue_empty", "output", "wakeup", "planning",
                      "staging_fence", "planning", "launch"]
    # On cuda the H2D copy precedes device_start, so it can be idle time; it outranks planning and latency.
    after.h2d_ms = 1.0
    cuda = attribute_gaps([before, after], h2d_before_start=True).causes_ms
    assert cuda["h2d"] == pytest.approx(1.0) and cuda["launch"] == pytest.approx(1.0)
    assert cuda["queue_empty"] == 0.0 and sum(cuda.values()) == pytest.approx(10.0)


def test_release_work_after_a_launch_is_idle_time_only_where_it_outlasts_the_step():
    """``settle_ms`` starts at ``launch_end``: the part of it past the step's end, before the next plan, is
    ``release``; the part while the step ran is not idle time at all."""
    first = record(0, plan_start=0, schedule_end=0.5, fence_start=0.5, fence_end=0.5, plan_end=0.8, launch_end=1,
                   device_start=1.2, device_end=3, settle_ms=3.0)  # settling 1-4: 3-4 outlasts the step
    second = record(1, plan_start=4, schedule_end=4.5, fence_start=4.5, fence_end=4.5, plan_end=4.8, launch_end=5,
                    device_start=5.5, device_end=7)
    c = attribute_gaps([first, second]).causes_ms
    assert c["release"] == pytest.approx(1.0)
    assert c["planning"] == pytest.approx(1.0) and c["launch"] == pytest.approx(0.5)
    assert sum(c.values()) == pytest.approx(2.5)
    assert summarize([first, second])["settle_ms_per_step"] == pytest.approx(1.5)
    # Recorded where it began (the core releases after sending the held outputs): 3.5-4.5 here, 1 ms past the end.
    first.settle_start, first.settle_ms = 3.5e-3, 1.0
    c = attribute_gaps([first, second]).causes_ms
    assert c["release"] == pytest.approx(0.5) and sum(c.values()) == pytest.approx(2.5)


def test_a_wait_for_grammar_masks_inside_a_step_is_idle_time_of_its_own():
    """A step whose forward ended before its masks were filled waited inside itself: not busy, and not a gap
    between steps either; busy + idle still equals the span, and every view (report, summary, trace) agrees."""
    first = record(0, device_start=1, device_end=5)
    second = record(1, device_start=6, device_end=13, mask_wait_start=9, mask_wait_ms=3.0, mask_fill_ms=2.5)
    second.grammar_rows = 5
    report = attribute_gaps([first, second])
    assert report.causes_ms["grammar_mask"] == pytest.approx(3.0)
    assert report.busy_ms == pytest.approx(8.0) and report.idle_ms == pytest.approx(4.0)
    assert report.busy_ms + report.idle_ms == pytest.approx(report.span_ms)
    assert sum(report.causes_ms.values()) == pytest.approx(report.idle_ms)
    summary = summarize([first, second])
    assert summary["device_busy_fraction"] == pytest.approx(8.0 / 12.0)
    assert summary["mask_fill_us_per_row"] == pytest.approx(500.0)
    run = types.SimpleNamespace(records=[first, second], report=report)
    from asyncbatch.profiling.trace_export import _idle

    waits = [e for e in _idle(run, 1, 0.0) if e["name"] == "grammar_mask"]
    assert len(waits) == 1 and waits[0]["dur"] == pytest.approx(3000.0)


def test_idle_time_is_split_by_the_kind_of_step_it_delayed():
    """Each gap counts under the step after it: admitting, after requests left, or steady; a grammar-mask wait
    under its own step. The kinds' steps, busy and idle add up to the report's."""
    steps = [record(i, device_start=10 * i + 1, device_end=10 * i + 9) for i in range(5)]  # 2 ms gaps, 8 ms steps
    for r, running, admitted in zip(steps, (4, 8, 8, 6, 6), (4, 4, 0, 0, 0)):
        r.num_running, r.num_admitted = running, admitted
    steps[4].device_start, steps[4].mask_wait_ms = 42e-3, 1.0  # a 3 ms gap, and a wait inside the step
    report = attribute_gaps(steps)
    kinds = report.kinds
    assert set(kinds) == set(STEP_KINDS)
    assert [kinds[k].steps for k in STEP_KINDS] == [2, 1, 2]  # steps 0-1, 3 (8 -> 6 running), 2 and 4
    assert kinds["admitting"].idle_ms == pytest.approx(2.0)  # before step 1; step 0 has no gap before it
    assert kinds["finishing"].idle_ms == pytest.approx(2.0)
    assert kinds["steady"].idle_ms == pytest.approx(2.0 + 3.0 + 1.0)
    assert kinds["steady"].busy_ms == pytest.approx(8.0 + 6.0)  # step 4: 7 ms less its 1 ms wait
    assert kinds["finishing"].busy_fraction == pytest.approx(0.8)
    assert report.kind_busy_fraction("steady") == pytest.approx(14.0 / 20.0)
    assert sum(k.idle_ms for k in kinds.values()) == pytest.approx(report.idle_ms)
    assert sum(k.busy_ms for k in kinds.values()) == pytest.approx(report.busy_ms)
    assert report.to_dict()["step_kinds"]["finishing"] == {"steps": 1, "busy_ms": pytest.approx(8.0),
                                                           "idle_ms": pytest.approx(2.0), "busy_fraction": pytest.approx(0.8)}
    empty = attribute_gaps([])
    assert empty.kind_busy_fraction("steady") == 1.0 and empty.kinds["admitting"].steps == 0


def test_overlap_planner_waiting_is_not_result_time():
    # Step 1 was launched before step 0 ended: the gap is launch latency, not the planner's wait for step 0.
    before = record(0, plan_start=1, fence_start=1, fence_end=1, launch_end=2, device_start=2, device_end=10,
                    wait_start=6, wait_end=10.5, apply_end=11)
    after = record(1, plan_start=3, fence_start=3, fence_end=3, launch_end=5, device_start=12, device_end=20)
    c = attribute_gaps([before, after]).causes_ms
    assert c["result"] == 0.0
    assert c["apply"] == pytest.approx(0.5) and c["launch"] == pytest.approx(1.5)


# -- acceptance (3): NVTX absent or disabled --------------------------------------------------
class RecordingDomain:
    """A stand-in for nvtx's domain that records every range with its thread and clock readings."""

    def __init__(self) -> None:
        self.ranges: list[tuple[str, str, object, float, float]] = []
        self.steps: dict[int, list] = {}
        self._stacks: dict[int, list] = {}
        self._lock = threading.Lock()

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return (message, payload)

    def push_range(self, attributes) -> None:
        self._stacks.setdefault(threading.get_ident(), []).append((attributes, time.perf_counter()))

    def pop_range(self) -> None:
        (message, payload), start = self._stacks[threading.get_ident()].pop()
        with self._lock:
            self.ranges.append((threading.current_thread().name, message, payload, start, time.perf_counter()))

    def start_range(self, attributes) -> int:
        with self._lock:
            self.steps[len(self.steps)] = [attributes, time.perf_counter(), None]
            return len(self.steps) - 1

    def end_range(self, range_id: int) -> None:
        self.steps[range_id][2] = time.perf_counter()


def install_fake_nvtx(monkeypatch) -> RecordingDomain:
    domain = RecordingDomain()
    monkeypatch.setitem(sys.modules, "nvtx", types.SimpleNamespace(get_domain=lambda name: domain))
    monkeypatch.setattr(timeline_marks, "_nvtx", None)
    monkeypatch.setattr(timeline_marks, "_domain", None)
    return domain


def test_ranges_come_from_the_calls_that_feed_the_timeline(make_llm, monkeypatch):
    domain = install_fake_nvtx(monkeypatch)
    assert enable_nvtx(True)
    llm, _ = run(make_llm, True, engine_process=False)  # the fake NVTX domain lives in this process
    enable_nvtx(False)
    assert all(not stack for stack in domain._stacks.values()), "every pushed range was popped"
    fields = {"wait_staging_fence": ("fence_start", "fence_end"), "prepare_metadata": ("fence_end", "plan_end"),
              "launch": ("plan_end", "launch_end"), "wait_step": ("wait_start", "wait_end"),
              "apply": ("wait_end", "apply_end"), "output": ("output_start", "output_end")}
    by_key = {}
    for thread, message, step, start, end in domain.ranges:
        by_key.setdefault((message.split(" ")[0], step), []).append((thread, start, end))
    for r in llm.timeline.window():
        for name, (start_field, end_field) in fields.items():
            (thread, start, end), = by_key[(name, r.step_id)]
            assert getattr(r, start_field) <= start <= end <= getattr(r, end_field), (name, r.step_id)
            assert thread == ("asyncbatch-output" if name == "output" else "asyncbatch-planner")


def test_engine_runs_unchanged_without_nvtx(make_llm, monkeypatch):
    _, with_marks = run(make_llm, True)  # NVTX off (fixture)
    monkeypatch.setitem(sys.modules, "nvtx", None)  # "import nvtx" now raises ImportError
    monkeypatch.setattr(timeline_marks, "_nvtx", None)
    monkeypatch.setattr(timeline_marks, "_domain", None)
    assert enable_nvtx(True) is False and not nvtx_enabled()
    assert mark("forward", 1) is mark("schedule")  # the shared no-op range
    assert timeline_marks.step_begin(1, 1, 0, 1) is None
    assert measure_mark_overhead(1000).enabled_ns is None
    for overlap in (True, False):
        llm, outputs = run(make_llm, overlap)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in with_marks]
        assert gap_report(llm).steps == len(llm.timeline.window())
    with count_ranges() as counter, mark("forward", 3):  # counting works without the package too
        pass
    assert counter.stage_ranges == 1 and not nvtx_enabled()


def test_step_ranges_bound_the_message_cache(monkeypatch):
    domain = install_fake_nvtx(monkeypatch)
    cleared = []
    monkeypatch.setattr(RecordingDomain, "get_registered_string", types.SimpleNamespace(
        cache_clear=lambda: cleared.append(1)), raising=False)
    monkeypatch.setattr(timeline_marks, "_MESSAGE_CACHE_LIMIT", 3)
    monkeypatch.setattr(timeline_marks, "_messages", 0)  # ranges counted by earlier tests must not shift the count
    enable_nvtx(True)
    for step in range(4):
        timeline_marks.step_end(timeline_marks.step_begin(step, 4, 1, 40))
        with mark("prepare_metadata", step, f" rows={step}"):
            pass
    assert len(cleared) == 2  # 8 ranges, emptied at the 3rd and the 6th
    assert domain.steps[0][0] == ("step 0 decode=4 prefill=1 tokens=40", 0) and domain.steps[0][2] is not None


def test_mark_overhead_is_measured():
    result = measure_mark_overhead(2000)
    assert result.baseline_ns > 0 and result.disabled_ns > 0
    assert not nvtx_enabled()


# -- the profile command ----------------------------------------------------------------------
def test_profile_command_writes_report_trace_and_plot(tmp_path, capsys):
    from asyncbatch.cli.main import main

    out = tmp_path / "prof"
    code = main(["profile", "--num-requests", "6", "--prompt-len", "8-24", "--output-len", "4-10",
                 "--warmup-requests", "2", "--sim-step-ms", "0.5", "--window", "8", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "overlap" in text and "sync" in text and "SIMULATED" in text
    report = json.loads((out / "report.json").read_text())
    assert report["identical_tokens"] is True
    assert report["environment"]["commit"] and report["environment"]["hardware"]
    for mode in ("overlap", "sync"):
        gaps = report["runs"][mode]["gap_report"]
        stats = report["runs"][mode]["stats"]
        idle = stats["idle_gap_ms_mean"] * (stats["steps"] - 1)
        assert sum(gaps["causes_ms"].values()) == pytest.approx(idle, rel=0.05, abs=1e-6)
        assert sum(k["idle_ms"] for k in gaps["step_kinds"].values()) == pytest.approx(gaps["idle_ms"])
    assert "idle ms (steps) and device busy by step kind:" in text
    # The admission figure per mode, as the gap report holds it (every run admitted its six requests).
    row = next(line for line in text.splitlines() if line.startswith("admission us per admitted request"))
    shown = re.findall(r"(\d+\.\d+) / (\d+\.\d+)", row)
    expected = [(f"{g['admission_us_per_request']:.2f}", f"{g['admission_cpu_us_per_request']:.2f}")
                for g in (report["runs"][mode]["gap_report"] for mode in ("overlap", "sync"))]
    assert shown == expected and all(float(wall) > 0 for wall, _ in shown)
    # Applying a step's tokens, wall and the planner thread's CPU: a thread's CPU time never exceeds the wall.
    for label in ("apply ms per step: wall / CPU", "  the longest apply: wall / CPU"):
        row = next(line for line in text.splitlines() if line.startswith(label))
        pairs = [(float(w), float(c)) for w, c in re.findall(r"(\d+\.\d+) / (\d+\.\d+)", row)]
        assert len(pairs) == 2 and all(0 < c <= w + 0.01 for w, c in pairs), row
    trace = json.loads((out / "trace.json").read_text())
    assert set(run_pids(trace)) == {"overlap", "sync"}
    assert_well_nested(trace)
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Idle-gap report" in (out / "report.md").read_text()


def test_profile_repeats_shows_the_median_run_and_the_range_of_every_run(tmp_path, capsys):
    """``--repeats 3``: three runs of each mode; the table is the median one by device busy, and the summary
    and ``report.json`` carry every run's figures."""
    from asyncbatch.cli.main import main

    out = tmp_path / "prof"
    code = main(["profile", "--num-requests", "4", "--prompt-len", "8", "--output-len", "6", "--warmup-requests",
                 "1", "--sim-step-ms", "0.5", "--repeats", "3", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["identical_tokens"] is True
    for mode in ("overlap", "sync"):
        runs = report["repeats"][mode]
        assert len(runs) == 3
        busy = sorted(r["device_busy"] for r in runs)
        assert report["runs"][mode]["gap_report"]["device_busy_fraction"] == busy[1]  # the table's: the median
    summary = text[text.index("over 3 runs of each mode: median [min - max]"):]
    row = next(line for line in summary.splitlines() if line.strip().startswith("device busy"))
    shown = re.findall(r"(\d+\.\d)% \[(\d+\.\d)-(\d+\.\d)\]", row)
    expected = []
    for mode in ("overlap", "sync"):
        busy = sorted(100 * r["device_busy"] for r in report["repeats"][mode])
        expected.append((f"{busy[1]:.1f}", f"{busy[0]:.1f}", f"{busy[2]:.1f}"))
    assert shown == expected
    assert main(["profile", "--repeats", "2", "--torch-profiler"]) == 2  # a usage error, before any engine starts
    assert "--torch-profiler records one run" in capsys.readouterr().err
