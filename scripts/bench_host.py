#!/usr/bin/env python
"""Does the host outrun the device? Host-side figures, optionally before vs after in one run.

Four sections, each a table of the report:

1. planner: the planner's critical path per step (planning + applying the step's tokens) in steady
   decode, at 16 / 64 / 256 / 1024 / 2048 running requests, on the simulated device with a flat 2 ms
   step (no per-token or per-context cost), overlap mode, max_num_seqs = N and a token budget of
   max(2048, 2N) (room to prefill every request while the first ones decode). Medians and p90 over
   the steady decode window (every request decoding).
2. busy: device busy fraction with 256 running at 0.5 / 1 / 2 ms steps and 1024 running at 1 ms, over
   the steady window and over the whole run, and output tokens per second of wall time.
3. gil: the same 256-running, 1 ms-step workload while a caller thread spins a pure-Python loop for
   the whole ``generate`` (and without it, for reference), in every process mode the code offers.
4. cpu: the README's 32-request workload on the default model with ``device="cpu"``.

Sections 1-3 run on the simulated device and are labelled so. Only the stable public API is used
(``LLM``, ``SamplingParams``, ``SimConfig``, ``stats()``, ``timeline.records``), so the script measures
old and new trees alike. ``--ref GITREF`` checks that revision out into a temporary git worktree and
measures it too, section by section in alternating order, each revision in its own subprocess
importing its own tree; the report puts them side by side with the after/before ratio ("after" is
the tree this script lives in). No timing is asserted; goals are printed as met or not.

Full report, before vs after::

    python scripts/bench_host.py --ref <commit> --out profiles/host-vs-device-<machine>

Smoke run (well under a minute on two cores)::

    python scripts/bench_host.py --quick --skip-cpu --out /tmp/bench-host
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.common import COMMON, git, log, ref_worktree, run_in_tree

ROOT = Path(__file__).resolve().parents[1]
# Run as ``python scripts/bench_host.py``, sys.path[0] is scripts/, and the editable install would
# import whichever checkout it points at; the script measures the tree it lives in, so that tree comes first.
if (ROOT / "asyncbatch").is_dir() and str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("planner", "busy", "gil", "cpu")
SIM_LABEL = "simulated device (sim): each step sleeps a fixed time; no GPU involved"
TOKEN_ID_RANGE = (300, 40000)
IN_PROCESS, CHILD_PROCESS = "in-process", "child process"


# -- sizes -------------------------------------------------------------------------------------------

@dataclass
class Sizes:
    """Every size the measurements use; resolved once from the flags and ``--quick``."""

    planner_running: list[int]
    max_tokens: int
    planner_step_ms: float
    busy_running: int
    busy_steps_ms: list[float]
    busy_big_running: int
    busy_big_step_ms: float
    hog_running: int
    hog_step_ms: float
    cpu_requests: int
    cpu_prompt_range: tuple[int, int]
    cpu_output_range: tuple[int, int]
    repeats: int
    engine_process: str  # "default" | "on" | "off": the process mode of sections 1, 2 and 4


FULL: dict[str, Any] = {
    "planner_running": [16, 64, 256, 1024, 2048], "max_tokens": 120, "planner_step_ms": 2.0,
    "busy_running": 256, "busy_steps_ms": [0.5, 1.0, 2.0], "busy_big_running": 1024, "busy_big_step_ms": 1.0,
    "hog_running": 256, "hog_step_ms": 1.0,
    "cpu_requests": 32, "cpu_prompt_range": (16, 128), "cpu_output_range": (8, 128), "repeats": 3,
}
# Every section still runs (the smoke test checks each), on fewer and shorter requests.
QUICK: dict[str, Any] = dict(FULL, planner_running=[16, 256], max_tokens=40, busy_big_running=512,
                             cpu_requests=8, cpu_prompt_range=(16, 32), cpu_output_range=(8, 16), repeats=1)


def resolve_sizes(args: argparse.Namespace) -> Sizes:
    """A flag given on the command line wins; otherwise the full or the quick default."""
    base = QUICK if args.quick else FULL
    values = {name: getattr(args, name) if getattr(args, name) is not None else default
              for name, default in base.items()}
    values["cpu_prompt_range"] = tuple(values["cpu_prompt_range"])
    values["cpu_output_range"] = tuple(values["cpu_output_range"])
    return Sizes(**values, engine_process=args.engine_process)


def sizes_to_argv(sizes: Sizes) -> list[str]:
    """The flags that make a child process measure exactly these sizes."""
    argv: list[str] = []
    for name, value in dataclasses.asdict(sizes).items():
        flag = "--" + name.replace("_", "-")
        argv += [flag, *map(str, value)] if isinstance(value, (list, tuple)) else [flag, str(value)]
    return argv


# -- the engine, through the public API only -------------------------------------------------------

def engine_process_supported() -> bool:
    import asyncbatch

    return "engine_process" in {f.name for f in dataclasses.fields(asyncbatch.EngineConfig)}


def requested_process(choice: str) -> bool | None:
    """None leaves the keyword out (the code's default, and the only option for old trees)."""
    if choice == "default" or not engine_process_supported():
        return None
    return choice == "on"


def make_llm(engine_process: bool | None, **kwargs: Any) -> Any:
    from asyncbatch import LLM

    if engine_process is not None:
        kwargs["engine_process"] = engine_process
    return LLM(seed=0, **kwargs)


def process_mode(llm: Any) -> str:
    if not engine_process_supported():
        return IN_PROCESS
    import asyncbatch

    default = {f.name: f.default for f in dataclasses.fields(asyncbatch.EngineConfig)}["engine_process"]
    return CHILD_PROCESS if getattr(getattr(llm, "config", None), "engine_process", default) else IN_PROCESS


def make_sim_llm(running: int, step_ms: float, max_tokens: int, engine_process: bool | None) -> Any:
    from asyncbatch import SimConfig

    # Flat device time: every step costs step_ms whatever its size, so the host is all that varies.
    sim = SimConfig(step_fixed_ms=step_ms, per_token_us=0.0, per_context_token_ns=0.0,
                    output_len_distribution="fixed", output_len_min=max_tokens, output_len_max=max_tokens)
    return make_llm(engine_process, model=None, device="sim", max_num_seqs=running,
                    max_num_batched_tokens=token_budget(running), overlap=True, sim=sim)


def token_budget(running: int) -> int:
    """Tokens per step: at least 2048, and room for prefill beside ``running`` decodes. With a budget of
    exactly ``running`` (2048 at 2048 running), the early requests' decodes crowd out the late ones'
    prefill until the early ones finish, so no step ever has every request decoding: no steady window."""
    return max(2048, 2 * running)


def steady_window_fn() -> tuple[Callable[[list, int], list], str]:
    """The tree's own ``steady_decode_window`` (new path first), else the same few lines here."""
    with contextlib.suppress(ImportError):
        from asyncbatch.profiling.timeline import steady_decode_window

        return steady_decode_window, "asyncbatch.profiling.timeline"
    with contextlib.suppress(ImportError):
        from asyncbatch.timeline import steady_decode_window

        return steady_decode_window, "asyncbatch.timeline"
    raise ImportError("neither asyncbatch.profiling.timeline nor asyncbatch.timeline has steady_decode_window")


# -- workloads ---------------------------------------------------------------------------------------

def sim_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(rng.randint(16, 32))] for _ in range(n)]


def greedy_params(max_tokens: list[int]) -> list[Any]:
    from asyncbatch import SamplingParams

    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, seed=i) for i, m in enumerate(max_tokens)]


def cpu_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                 seed: int = 0) -> tuple[list[list[int]], list[Any]]:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(*TOKEN_ID_RANGE) for _ in range(rng.randint(*prompt_range))])
        outputs.append(rng.randint(*output_range))
    return prompts, greedy_params(outputs)


# -- one measured generate -----------------------------------------------------------------------

@dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    stats: dict
    records: list | None  # this generate's completed steps; None where the mode exposes no timeline
    hog_loops_per_s: float | None = None


class GilHog:
    """A caller thread spinning pure Python for as long as it runs: it wants the GIL all the time."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.loops = 0
        self._thread = threading.Thread(target=self._spin, name="bench-gil-hog", daemon=True)

    def _spin(self) -> None:
        while not self._stop.is_set():
            sum(range(200))
            self.loops += 1

    def __enter__(self) -> GilHog:  # noqa: PYI034 - not meant to be subclassed
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timeline_records(llm: Any) -> list | None:
    """A copy of the step records, or None where the mode keeps no timeline on this side."""
    records = getattr(getattr(llm, "timeline", None), "records", None)
    return None if records is None else list(records)


def run_once(llm: Any, prompts: list, params: list, hog: bool = False) -> RunResult:
    before = timeline_records(llm)
    start_index = len(before) if before is not None else 0
    gc.collect()  # a collection owed by setup should not land inside the measurement
    llm.reset_stats()
    reset_cache = getattr(llm, "reset_prefix_cache", None)  # repeats must not reuse each other's prompts
    if reset_cache is not None:  # (the reference tree may predate prefix caching)
        reset_cache()
    with GilHog() if hog else contextlib.nullcontext() as spinner:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    # An overlap step launched before the last finish may still be in flight when generate returns.
    wait_settled = getattr(llm, "wait_settled", None) or getattr(getattr(llm, "timeline", None), "wait_settled", None)
    if callable(wait_settled):
        wait_settled(5.0)
    after = timeline_records(llm)
    records = None if after is None else [r for r in after[start_index:] if r.device_end > 0]
    return RunResult(wall, sum(len(o.token_ids) for o in outputs), llm.stats(), records,
                     spinner.loops / wall if spinner is not None else None)


def warm_up(llm: Any) -> None:
    """First-call costs (imports, allocations, thread start) stay out of every measured run."""
    llm.generate(sim_prompts(8, seed=99), greedy_params([4] * 8), use_tqdm=False)


# -- per-step figures -----------------------------------------------------------------------------

def critical_ms(record: Any) -> float:
    """Planner time on the step's path: schedule + metadata + launch, plus applying its tokens."""
    return record.planner_ms + (record.apply_end - record.wait_end) * 1e3


def busy_fraction(records: list) -> float:
    if not records:
        return math.nan
    busy = sum(r.device_end - r.device_start for r in records)
    span = records[-1].device_end - records[0].device_start
    return busy / span if span > 0 else 1.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run_metrics(result: RunResult) -> dict[str, float]:
    """What every section reports of a run: wall throughput and the stats() summary of the whole run."""
    stats = result.stats
    metrics = {
        "output_tokens": float(result.output_tokens),
        "wall_s": result.wall_s,
        "wall_tok_s": result.output_tokens / result.wall_s if result.wall_s > 0 else math.nan,
        "steps": float(stats.get("steps", math.nan)),
        "busy_run": float(stats.get("device_busy_fraction", math.nan)),
        "idle_gap_ms_mean": float(stats.get("idle_gap_ms_mean", math.nan)),
        "planner_ms_mean": float(stats.get("planner_ms_per_step", math.nan)),
        "apply_ms_mean": float(stats.get("apply_ms_per_step", math.nan)),
        "output_ms_mean": float(stats.get("output_ms_per_step", math.nan)),
        "device_ms_mean": float(stats.get("device_ms_per_step", math.nan)),
    }
    if isinstance(stats.get("preemptions"), int):
        metrics["preemptions"] = float(stats["preemptions"])
    if result.hog_loops_per_s is not None:
        metrics["hog_loops_per_s"] = result.hog_loops_per_s
    return metrics


def window_metrics(result: RunResult, min_decode: int) -> dict[str, float]:
    """Per-step figures over the steady decode window; stats() means of the whole run without a timeline."""
    if result.records is None:
        stats = result.stats
        crit = float(stats.get("planner_ms_per_step", math.nan)) + float(stats.get("apply_ms_per_step", math.nan))
        return {"window_steps": float(stats.get("steps", math.nan)), "crit_ms_p50": crit, "crit_ms_p90": math.nan,
                "planner_ms_p50": float(stats.get("planner_ms_per_step", math.nan)),
                "apply_ms_p50": float(stats.get("apply_ms_per_step", math.nan)),
                "busy_window": float(stats.get("device_busy_fraction", math.nan)), "from_timeline": 0.0}
    window_fn, _ = steady_window_fn()
    window = window_fn(result.records, min_decode)
    crit = [critical_ms(r) for r in window]
    return {
        "window_steps": float(len(window)),
        "crit_ms_p50": percentile(crit, 0.5),
        "crit_ms_p90": percentile(crit, 0.9),
        "planner_ms_p50": percentile([r.planner_ms for r in window], 0.5),
        "apply_ms_p50": percentile([(r.apply_end - r.wait_end) * 1e3 for r in window], 0.5),
        "busy_window": busy_fraction(window),
        "gc_ms_p50": percentile([float(getattr(r, "gc_ms", 0.0)) for r in window], 0.5),
        "from_timeline": 1.0,
    }


def median_metrics(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, the median over repeats (NaN where any repeat lacks a finite value)."""
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    merged = {}
    for key in keys:
        values = [r[key] for r in runs]
        merged[key] = statistics.median(values) if all(math.isfinite(v) for v in values) else math.nan
    merged["repeats"] = float(len(runs))
    return merged


# -- sections ------------------------------------------------------------------------------------

Row = dict[str, Any]  # {"key": str, "config": dict, "metrics": dict[str, float]}


def measure_sim(running: int, step_ms: float, sizes: Sizes, engine_process: bool | None,
                hog_variants: tuple[bool, ...] = (False,)) -> tuple[str, dict[bool, dict[str, float]]]:
    """One engine, ``sizes.repeats`` runs of each hog variant (interleaved), medians per variant."""
    prompts = sim_prompts(running)
    params = greedy_params([sizes.max_tokens] * running)
    runs: dict[bool, list[dict[str, float]]] = {hog: [] for hog in hog_variants}
    with make_sim_llm(running, step_ms, sizes.max_tokens, engine_process) as llm:
        mode = process_mode(llm)
        warm_up(llm)
        for _ in range(sizes.repeats):
            for hog in hog_variants:
                result = run_once(llm, prompts, params, hog=hog)
                runs[hog].append(run_metrics(result) | window_metrics(result, min_decode=running))
    return mode, {hog: median_metrics(r) for hog, r in runs.items()}


def planner_key(running: int) -> str:
    return f"{running} running"


def busy_key(running: int, step_ms: float) -> str:
    return f"{running} running @ {step_ms:g} ms"


def gil_key(hog: bool, mode: str) -> str:
    return f"{'GIL hog' if hog else 'no hog'}, {mode}"


def sim_row(key: str, metrics: dict[str, float], running: int, step_ms: float, sizes: Sizes, mode: str,
            **extra: Any) -> Row:
    config = {"running": running, "token_budget": token_budget(running), "step_ms": step_ms,
              "max_tokens": sizes.max_tokens, "process_mode": mode, **extra}
    return {"key": key, "config": config, "metrics": metrics}


def section_planner(sizes: Sizes) -> list[Row]:
    rows = []
    for running in sizes.planner_running:
        log(f"planner: {running} running")
        mode, metrics = measure_sim(running, sizes.planner_step_ms, sizes, requested_process(sizes.engine_process))
        rows.append(sim_row(planner_key(running), metrics[False], running, sizes.planner_step_ms, sizes, mode))
    return rows


def section_busy(sizes: Sizes) -> list[Row]:
    points = [(sizes.busy_running, s) for s in sizes.busy_steps_ms]
    points.append((sizes.busy_big_running, sizes.busy_big_step_ms))
    rows = []
    for running, step_ms in dict.fromkeys(points):
        log(f"busy: {busy_key(running, step_ms)}")
        mode, metrics = measure_sim(running, step_ms, sizes, requested_process(sizes.engine_process))
        rows.append(sim_row(busy_key(running, step_ms), metrics[False], running, step_ms, sizes, mode))
    return rows


def section_gil(sizes: Sizes) -> list[Row]:
    modes: list[bool | None] = [False, True] if engine_process_supported() else [None]
    rows = []
    for engine_process in modes:
        log(f"gil: engine_process={engine_process}")
        mode, by_hog = measure_sim(sizes.hog_running, sizes.hog_step_ms, sizes, engine_process,
                                   hog_variants=(False, True))
        for hog, metrics in by_hog.items():
            rows.append(sim_row(gil_key(hog, mode), metrics, sizes.hog_running, sizes.hog_step_ms, sizes, mode,
                                hog=hog))
    return rows


def section_cpu(sizes: Sizes) -> list[Row]:
    prompts, params = cpu_workload(sizes.cpu_requests, sizes.cpu_prompt_range, sizes.cpu_output_range)
    log(f"cpu: default model, {sizes.cpu_requests} requests")
    runs = []
    with make_llm(requested_process(sizes.engine_process), model=None, device="cpu", overlap=True) as llm:
        mode = process_mode(llm)
        llm.generate(prompts[:2], greedy_params([2, 2]), use_tqdm=False)
        for _ in range(sizes.repeats):
            runs.append(run_metrics(run_once(llm, prompts, params)))
    return [{"key": f"{sizes.cpu_requests} requests, default model", "metrics": median_metrics(runs),
             "config": {"requests": sizes.cpu_requests, "prompt_range": list(sizes.cpu_prompt_range),
                        "output_range": list(sizes.cpu_output_range), "process_mode": mode}}]


SECTION_FUNCS: dict[str, Callable[[Sizes], list[Row]]] = {
    "planner": section_planner, "busy": section_busy, "gil": section_gil, "cpu": section_cpu}


# -- facts about the machine and the revision ------------------------------------------------------

def revision_info() -> dict[str, Any]:
    import asyncbatch

    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = git("rev-parse", "HEAD")
        if git("status", "--porcelain", "--untracked-files=no"):
            commit += " + uncommitted changes"
    return {"commit": commit, "tree": str(ROOT), "package": str(Path(asyncbatch.__file__).parent),
            "engine_process_supported": engine_process_supported(), "steady_window_from": steady_window_fn()[1]}


def measure(sizes: Sizes, sections: list[str]) -> dict[str, Any]:
    """This tree's document: revision and the rows of each section (or its error). The machine is the
    parent's to describe (``asyncbatch.bench.report``, which an older tree may lack)."""
    doc: dict[str, Any] = {"revision": revision_info(), "sections": {}}
    for name in sections:
        try:
            doc["sections"][name] = {"rows": SECTION_FUNCS[name](sizes)}
        # One failing section (an old tree lacking something) must not lose the others' figures.
        except Exception as exc:  # noqa: BLE001
            log(f"{name}: failed: {exc!r}")
            doc["sections"][name] = {"error": repr(exc)}
    return doc


# -- before vs after: subprocesses on two trees ---------------------------------------------------

def run_child(tree: Path, sizes: Sizes, section: str, timeout_s: float) -> dict[str, Any]:
    """Measure one section on ``tree`` in a fresh interpreter that imports that tree's package."""
    with tempfile.TemporaryDirectory(prefix="bench-host-") as tmp:
        out = Path(tmp) / "doc.json"
        try:
            proc = run_in_tree(tree, Path(__file__), ["--json-out", str(out), "--sections", section,
                                                      *sizes_to_argv(sizes)], timeout_s)
        except subprocess.TimeoutExpired:
            return {"sections": {section: {"error": f"timed out after {timeout_s:.0f} s"}}}
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0 or not out.exists():
            return {"sections": {section: {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}}}
        return json.loads(out.read_text())


def merge_child(doc: dict[str, Any] | None, child: dict[str, Any]) -> dict[str, Any]:
    if doc is None:
        return {"revision": child.get("revision"), "sections": child["sections"]}
    doc["revision"] = doc.get("revision") or child.get("revision")
    doc["sections"].update(child["sections"])
    return doc


def measure_both(ref_tree: Path, sizes: Sizes, sections: list[str],
                 timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both revisions, section by section; who goes first alternates so drift does not favour one side."""
    trees = {"after": ROOT, "before": ref_tree}
    docs: dict[str, dict[str, Any] | None] = {"after": None, "before": None}
    for i, section in enumerate(sections):
        order = ("after", "before") if i % 2 == 0 else ("before", "after")
        for side in order:
            log(f"== {section}: {side} ({trees[side]})")
            docs[side] = merge_child(docs[side], run_child(trees[side], sizes, section, timeout_s))
    return docs["after"], docs["before"]  # type: ignore[return-value]


# -- the report ----------------------------------------------------------------------------------

@dataclass
class Goal:
    section: str
    key: str
    metric: str
    op: str  # "<=" | ">="
    threshold: float
    text: str


def goals(sizes: Sizes) -> list[Goal]:
    return [
        Goal("planner", planner_key(256), "crit_ms_p50", "<=", 0.2, "plan+apply p50 <= 0.2 ms/step at 256 running"),
        Goal("planner", planner_key(2048), "crit_ms_p50", "<=", 0.6, "plan+apply p50 <= 0.6 ms/step at 2048 running"),
        Goal("busy", busy_key(sizes.busy_running, 1.0), "busy_window", ">=", 0.99, "busy (steady window) >= 99 % at 1 ms steps"),
        Goal("busy", busy_key(sizes.busy_running, 2.0), "busy_window", ">=", 0.99, "busy (steady window) >= 99 % at 2 ms steps"),
        Goal("busy", busy_key(sizes.busy_running, 0.5), "busy_window", ">=", 0.95, "busy (steady window) >= 95 % at 0.5 ms steps"),
        Goal("busy", busy_key(1024, 1.0), "busy_window", ">=", 0.99, "busy (steady window) >= 99 % at 1024 running, 1 ms steps"),
    ]


def evaluate(goal: Goal, metrics: dict[str, float] | None) -> bool | None:
    value = None if metrics is None else metrics.get(goal.metric)
    if value is None or not math.isfinite(value):
        return None
    return value <= goal.threshold if goal.op == "<=" else value >= goal.threshold


SECTION_INFO: dict[str, dict[str, Any]] = {
    "planner": {"title": "1. Planner critical path per step, steady decode", "simulated": True,
                "note": "planner (schedule + metadata + launch, fence wait excluded) + apply, per step, over the "
                        "steady decode window (every request decoding); flat device step, overlap mode, "
                        "max_num_seqs = N, token budget max(2048, 2N)",
                "show": ["process_mode", "window_steps", "crit_ms_p50", "crit_ms_p90", "planner_ms_p50",
                         "apply_ms_p50", "busy_window"]},
    "busy": {"title": "2. Device busy fraction, overlap", "simulated": True,
             "note": "busy over the steady decode window and over the whole generate (stats()); "
                     "tok/s is output tokens per second of generate's wall time",
             "show": ["process_mode", "busy_window", "busy_run", "idle_gap_ms_mean", "crit_ms_p50", "wall_tok_s"]},
    "gil": {"title": "3. GIL hog: a caller thread spinning Python during generate", "simulated": True,
            "note": "the hog runs `sum(range(200))` in a loop for the whole generate; hog loops/s is how much "
                    "the caller got done",
            "show": ["process_mode", "busy_window", "busy_run", "crit_ms_p50", "wall_tok_s", "hog_loops_per_s"]},
    "cpu": {"title": "4. Default model on cpu (real execution)", "simulated": False,
            "note": "the README's workload: prompts and outputs uniform in the ranges, greedy, ignore_eos",
            "show": ["process_mode", "wall_tok_s", "busy_run", "steps", "device_ms_mean", "planner_ms_mean"]},
}
LABELS = {"process_mode": "process mode", "window_steps": "steady steps", "crit_ms_p50": "plan+apply ms p50",
          "crit_ms_p90": "plan+apply ms p90", "planner_ms_p50": "planner ms p50", "apply_ms_p50": "apply ms p50",
          "busy_window": "busy (steady)", "busy_run": "busy (whole run)", "idle_gap_ms_mean": "idle gap ms mean",
          "wall_tok_s": "output tok/s (wall)", "hog_loops_per_s": "hog loops/s", "steps": "steps",
          "device_ms_mean": "device ms/step", "planner_ms_mean": "planner ms/step (mean)"}


def ratio(after: float | None, before: float | None) -> float | None:
    if after is None or before is None or not math.isfinite(after) or not math.isfinite(before) or before == 0:
        return None
    return after / before


def merge_section(name: str, after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any]:
    """Rows of both revisions matched by key, with the after/before ratio of every shared metric."""
    merged: dict[str, Any] = dict(SECTION_INFO[name], rows=[])
    for side, doc in (("after", after), ("before", before)):
        if doc is not None and "error" in doc:
            merged[f"{side}_error"] = doc["error"]
    by_key: dict[str, dict[str, Any]] = {}
    for side, doc in (("after", after), ("before", before)):
        for row in (doc or {}).get("rows", []):
            entry = by_key.setdefault(row["key"], {"key": row["key"], "after": None, "before": None})
            entry[side] = {"config": row["config"], "metrics": row["metrics"]}
    for entry in by_key.values():
        a, b = (entry[s]["metrics"] if entry[s] else {} for s in ("after", "before"))
        entry["ratio"] = {k: ratio(a[k], b[k]) for k in a if k in b}
        merged["rows"].append(entry)
    return merged


def build_report(after: dict[str, Any], before: dict[str, Any] | None, sizes: Sizes, sections: list[str],
                 ref: str | None) -> dict[str, Any]:
    from asyncbatch.bench.report import machine_info  # this tree's: the parent's, never an older one's

    report: dict[str, Any] = {
        "label": SIM_LABEL + " (sections planner, busy, gil); cpu section is real execution on this CPU",
        "machine": machine_info("sim (sections planner, busy, gil); cpu (section cpu)"),
        "ref": ref, "revisions": {"after": after.get("revision")}, "sizes": dataclasses.asdict(sizes),
        "sections": {}, "goals": []}
    if before is not None:
        report["revisions"]["before"] = before.get("revision")
    for name in sections:
        report["sections"][name] = merge_section(name, after["sections"].get(name),
                                                 None if before is None else before["sections"].get(name))
    for goal in goals(sizes):
        rows = {r["key"]: r for r in report["sections"].get(goal.section, {}).get("rows", [])}
        if goal.key not in rows:
            continue
        row = rows[goal.key]
        report["goals"].append(dict(dataclasses.asdict(goal), **{
            side: evaluate(goal, row[side]["metrics"] if row[side] else None) for side in ("after", "before")}))
    return report


def fmt(metric: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, str):
        return value
    if metric.startswith("busy"):
        return f"{100 * value:.2f} %"
    if metric in ("wall_tok_s", "hog_loops_per_s"):
        return f"{value:,.0f}"
    if metric in ("steps", "window_steps"):
        return f"{value:.0f}"
    return f"{value:.3f}"


def cell(side: dict[str, Any] | None, metric: str) -> Any:
    if side is None:
        return None
    return side["config"].get(metric) if metric == "process_mode" else side["metrics"].get(metric)


def section_markdown(section: dict[str, Any], two_sided: bool) -> list[str]:
    lines = [f"## {section['title']}", ""]
    if section["simulated"]:
        lines += [f"**{SIM_LABEL}.**", ""]
    lines += [section["note"] + ".", ""]
    for side in ("after", "before"):
        if f"{side}_error" in section:
            lines += [f"{side}: failed: `{section[f'{side}_error'][-300:]}`", ""]
    if two_sided:
        lines += ["| configuration | metric | before | after | after/before |", "|---|---|---|---|---|"]
    else:
        lines += ["| configuration | metric | value |", "|---|---|---|"]
    for row in section["rows"]:
        for metric in section["show"]:
            a, b = cell(row["after"], metric), cell(row["before"], metric)
            if a is None and b is None:
                continue
            label = LABELS.get(metric, metric)
            if two_sided:
                r = row["ratio"].get(metric)
                lines.append(f"| {row['key']} | {label} | {fmt(metric, b)} | {fmt(metric, a)} | "
                             f"{'—' if r is None else f'{r:.2f}x'} |")
            else:
                lines.append(f"| {row['key']} | {label} | {fmt(metric, a)} |")
    lines.append("")
    return lines


def goal_markdown(report: dict[str, Any], two_sided: bool) -> list[str]:
    if not report["goals"]:
        return []
    word = {True: "met", False: "NOT met", None: "not measured"}
    lines = ["## Goals", ""]
    for goal in report["goals"]:
        status = f"after: {word[goal['after']]}"
        if two_sided:
            status = f"before: {word[goal['before']]}, " + status
        lines.append(f"- [{goal['section']}] {goal['text']} ({goal['metric']} of {goal['key']}): {status}")
    return lines + [""]


def markdown(report: dict[str, Any]) -> str:
    two_sided = "before" in report["revisions"]
    m = report["machine"] or {}
    lines = ["# Host vs device: does the host outrun the device?", "",
             (f"Machine: {m.get('cpu')}, {m.get('cores')} cores; Python {m.get('python')}, "
              f"torch {m.get('torch')}, numpy {m.get('numpy')}."), ""]
    for side, rev in report["revisions"].items():
        rev = rev or {}
        lines.append(f"- {side}: commit {rev.get('commit')} ({rev.get('tree')}); "
                     f"engine_process {'supported' if rev.get('engine_process_supported') else 'not supported'}")
    lines += ["", (f"Sections 1-3: {SIM_LABEL}. Medians over {report['sizes']['repeats']} repeat(s) per "
                   "configuration; per-step figures are medians over steps."), ""]
    if report["sizes"]["repeats"] < 3:
        # Measured: the same commit on both sides of a 1-repeat run differed by up to ~1.9x on a shared
        # two-core machine, so such a run only shows that everything runs.
        lines += ["**Fewer than 3 repeats: a smoke run; the numbers and ratios are not meaningful.**", ""]
    lines += goal_markdown(report, two_sided)
    for section in report["sections"].values():
        lines += section_markdown(section, two_sided)
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", help="git revision to measure too (the 'before' side), in a temporary worktree")
    p.add_argument("--out", help="directory for report.md and report.json")
    p.add_argument("--json-out", help=argparse.SUPPRESS)  # child mode: write this tree's raw document only
    p.add_argument("--quick", action="store_true", help="smaller sizes everywhere: a smoke run")
    p.add_argument("--skip-cpu", action="store_true", help="leave out the default-model cpu section")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--child-timeout-s", type=float, default=1800.0, help="per section and revision with --ref")
    p.add_argument("--engine-process", choices=("default", "on", "off"), default="default",
                   help="process mode of sections 1, 2 and 4 where the code supports it (section 3 runs both)")
    p.add_argument("--planner-running", type=int, nargs="+", help="running requests of section 1")
    p.add_argument("--max-tokens", type=int, help="output tokens per request in the sim sections")
    p.add_argument("--planner-step-ms", type=float, help="device step of section 1")
    p.add_argument("--busy-running", type=int, help="running requests of section 2")
    p.add_argument("--busy-steps-ms", type=float, nargs="+", help="device steps of section 2")
    p.add_argument("--busy-big-running", type=int, help="the large batch of section 2")
    p.add_argument("--busy-big-step-ms", type=float, help="its device step")
    p.add_argument("--hog-running", type=int, help="running requests of section 3")
    p.add_argument("--hog-step-ms", type=float, help="device step of section 3")
    p.add_argument("--cpu-requests", type=int, help="requests of section 4")
    p.add_argument("--cpu-prompt-range", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--cpu-output-range", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--repeats", type=int, help="measured runs per configuration (medians)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = resolve_sizes(args)
    sections = [s for s in dict.fromkeys(args.sections) if not (s == "cpu" and args.skip_cpu)]
    if args.json_out:
        # To the parent only: NaN (not measured) stays NaN until the report is written.
        Path(args.json_out).write_text(json.dumps(measure(sizes, sections)))
        return 0
    if args.ref:
        with ref_worktree(args.ref, [Path(__file__), COMMON, COMMON.with_name("__init__.py")]) as tree:
            after, before = measure_both(tree, sizes, sections, args.child_timeout_s)
    else:
        after, before = measure(sizes, sections), None
    report = build_report(after, before, sizes, sections, args.ref)
    text = markdown(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(text)
        from asyncbatch.bench.report import write_json  # the parent's tree, as above

        write_json(report, out / "report.json", nan_as_null=True, indent=2)
        log(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    failed = [n for n, s in report["sections"].items() if "after_error" in s or "before_error" in s]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
