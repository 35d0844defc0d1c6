"""``python -m asyncbatch profile``: the idle-gap report, overlap and synchronous side by side.

Both modes get the same requests (seeded), each in a fresh engine after a short
warmup; the table gives device busy fraction, idle time per step and the share
of idle time per cause (``asyncbatch.profiling.gap_report``). With ``--out DIR`` it also
writes ``report.json``, ``report.md``, ``trace.json`` (both runs, Perfetto /
chrome://tracing) and ``timeline.png`` (a window of steps of both runs).

``--repeats N`` runs each mode N times, interleaved, each in a fresh engine: on a
noisy machine (a small VM's busy fraction can move by 30 points between two runs
of the same command) the table shows each mode's median run by device busy, and a
summary gives the median and range of every run's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asyncbatch.bench.workloads import WorkItem, uniform_requests
from asyncbatch.cli.args import engine_kwargs, non_negative, positive_int
from asyncbatch.config import SimConfig
from asyncbatch.engine.fork_server import start_early
from asyncbatch.profiling.gap_report import CAUSES, STEP_KINDS, GapReport, gap_report, lifetimes_of
from asyncbatch.profiling.host_info import cpu_name, git_commit
from asyncbatch.profiling.marks import (
    MarkOverhead,
    measure_mark_overhead,
    nvtx_enabled,
)
from asyncbatch.profiling.trace_export import TraceRun, export_trace, export_traces
from asyncbatch.sampling_params import SamplingParams

_SIM = SimConfig()  # defaults of the simulated device


@dataclass
class ModeRun:
    """One mode's measured run (the engine is closed; records and outputs stay)."""

    mode: str  # "overlap" | "sync"
    backend: str
    simulated: bool
    wall_s: float
    outputs: list
    stats: dict  # LLM.stats() of the measured window
    report: GapReport
    records: list
    lifetimes: list[tuple[float, float]]
    ranges_per_step: float  # NVTX ranges per step, counted during the warmup
    ranges_by_name: dict[str, float]

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    def trace_run(self) -> TraceRun:
        return TraceRun(self.records, self.backend, self.mode, self.simulated, self.lifetimes, self.report)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "simulated": self.simulated, "wall_s": self.wall_s,
                "output_tokens": self.output_tokens, "stats": self.stats, "gap_report": self.report.to_dict()}


def add_profile_command(subparsers, engine_args_fn: Callable[[argparse.ArgumentParser], None]) -> None:
    p = subparsers.add_parser("profile", help="idle-gap report: overlap vs synchronous on the same requests",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_args_fn(p)
    p.set_defaults(device="sim", func=cmd_profile)
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.add_argument("--prompt-len", default="16-128", help="MIN-MAX prompt tokens (uniform)")
    p.add_argument("--output-len", default="16-128", help="MIN-MAX output tokens (uniform, ignore_eos)")
    p.add_argument("--request-rate", type=non_negative(float), default=0.0,
                   help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--warmup-requests", type=non_negative(int), default=4)
    p.add_argument("--sim-step-ms", type=float, default=_SIM.step_fixed_ms, help="sim: fixed cost per step")
    p.add_argument("--sim-per-token-us", type=float, default=_SIM.per_token_us)
    p.add_argument("--sim-per-context-ns", type=float, default=_SIM.per_context_token_ns)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (cpu backend)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs of each mode, interleaved, each in a fresh engine: the table shows the median run "
                        "(by device busy), a summary the median and range of all")
    p.add_argument("--window", type=int, default=16, help="steps shown in timeline.png")
    p.add_argument("--window-start", type=int, default=None, help="first step index of the plot window")
    p.add_argument("--out", default=None, help="directory for report.json, report.md, trace.json, timeline.png")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges on during the measured runs (for nsys)")
    p.add_argument("--torch-profiler", action="store_true",
                   help="record the overlap run with torch.profiler and merge it into trace-overlap-torch.json")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"expected MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo_i, hi_i


def _engine_kwargs(args: argparse.Namespace, overlap: bool) -> dict:
    kwargs = {**engine_kwargs(args, overlap), "num_threads": args.num_threads}
    if args.device == "sim":
        kwargs["sim"] = SimConfig(step_fixed_ms=args.sim_step_ms, per_token_us=args.sim_per_token_us,
                                  per_context_token_ns=args.sim_per_context_ns)
    return kwargs


def _generate(llm, items: list[WorkItem], rate: float, seed: int) -> list:
    # Explicit seeds: with concurrent submission the arrival order (and so a derived seed) may differ per mode.
    params = [SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True, seed=seed * 100_003 + i)
              for i, it in enumerate(items)]
    prompts = [it.prompt_token_ids for it in items]
    if rate <= 0:
        return llm.generate(prompts, params, use_tqdm=False)
    # Poisson arrivals: one submitting thread per request, each sleeping until its arrival.
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(items)))
    outputs: list = [None] * len(items)
    start = time.perf_counter()

    def submit(i: int) -> None:
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        outputs[i] = llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0]

    threads = [threading.Thread(target=submit, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outputs


def _run_mode(args: argparse.Namespace, overlap: bool, out_dir: Path | None) -> ModeRun:
    start_early()  # the core's fork server imports the engine beside this process (engine.fork_server)
    from asyncbatch.llm import LLM

    nvtx_was_on = nvtx_enabled()  # ASYNCBATCH_NVTX=1 counts as --nvtx
    with LLM(args.model, **_engine_kwargs(args, overlap)) as llm:
        vocab = llm.tokenizer.vocab_size
        items = uniform_requests(args.num_requests, _range(args.prompt_len), _range(args.output_len), vocab,
                                 seed=args.seed)
        warmup = uniform_requests(args.warmup_requests, _range(args.prompt_len), (8, 8), vocab, seed=args.seed + 1)
        with llm.count_ranges() as counter:  # ranges per step, both processes (NVTX on only for the warmup)
            _generate(llm, warmup, 0.0, args.seed + 1)
            llm.wait_settled(5.0)
        warm_steps = max(len(llm.timeline.window()), 1)
        llm.set_nvtx(args.nvtx or nvtx_was_on)
        llm.reset_stats()
        profiler = _torch_profiler(llm.device) if args.torch_profiler and overlap else None
        start = time.perf_counter()
        with profiler if profiler is not None else contextlib.nullcontext():
            outputs = _generate(llm, items, args.request_rate, args.seed)
        wall = time.perf_counter() - start
        llm.wait_settled(5.0)
        llm.set_nvtx(nvtx_was_on)
        lifetimes = lifetimes_of(outputs)
        run = ModeRun("overlap" if overlap else "sync", llm.device, llm.simulated, wall, outputs, llm.stats(),
                      gap_report(llm, lifetimes), llm.timeline.window(), lifetimes,
                      (counter.stage_ranges + counter.step_ranges) / warm_steps,
                      {k: v / warm_steps for k, v in sorted(counter.by_name.items())})
        if profiler is not None and out_dir is not None:
            torch_path = out_dir / "torch-overlap.json"
            profiler.export_chrome_trace(str(torch_path))
            export_trace(run.trace_run(), out_dir / "trace-overlap-torch.json", torch_trace=torch_path)
        return run


def _torch_profiler(device: str):
    import torch
    from torch._C._profiler import _ExperimentalConfig

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # The engine's device and planner threads are not the caller's: profile every thread.
    return torch.profiler.profile(activities=activities, experimental_config=_ExperimentalConfig(
        profile_all_threads=True))


def environment(backend: str, sim: SimConfig | None) -> dict:
    """Hardware, commit and versions, for the report's header."""
    import torch

    host = f"{cpu_name()}, {os.cpu_count()} logical cores"
    if backend == "cuda":
        hardware = f"{torch.cuda.get_device_name(0)} (host: {host})"
    elif backend == "sim" and sim is not None:
        hardware = (f"simulated device ({sim.step_fixed_ms:g} ms + {sim.per_token_us:g} us/token + "
                    f"{sim.per_context_token_ns:g} ns/context token per step) on {host}")
    else:
        hardware = host
    commit = git_commit(mark_dirty=True) or "uncommitted working tree"
    return {"hardware": hardware, "commit": commit, "command": "python -m asyncbatch " + shlex.join(sys.argv[1:]),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _median_max(report: GapReport) -> str:
    gaps = [g.gap_ms for g in report.gaps] + [0.0] * (report.steps - 1 - len(report.gaps))  # zero gaps too
    return f"{np.median(gaps):.3f}/{max(gaps):.1f}" if gaps else "-"


def format_table(runs: list[ModeRun]) -> str:
    """The side-by-side table (plain text, also valid inside a Markdown code block)."""
    names = [r.mode for r in runs]
    # A space before every column: a value wider than its column (a slow machine's "102.43 / 102.73") stays apart.
    lines = [f"{'':<50}" + "".join(f" {n:>13}" for n in names)]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:<50}" + "".join(f" {v:>13}" for v in values))

    reports = [r.report for r in runs]
    row("steps", [str(rep.steps) for rep in reports])
    row("output tokens/s (wall)", [f"{r.output_tokens / r.wall_s:.1f}" for r in runs])
    row("device busy", [f"{100 * rep.busy_fraction:.1f}%" for rep in reports])
    row("device ms per step", [f"{rep.busy_ms / max(rep.steps, 1):.3f}" for rep in reports])
    row("idle ms per step", [f"{rep.idle_ms_per_step:.3f}" for rep in reports])
    row("idle ms per gap: median / largest", [_median_max(rep) for rep in reports])
    row("idle ms total", [f"{rep.idle_ms:.1f}" for rep in reports])
    lines.append("idle time by cause (% of idle time):")
    for key, label in CAUSES.items():
        row(f"  {label}", [f"{100 * rep.shares()[key]:.1f}" for rep in reports])
    row("  sum of causes / idle time", [f"{100 * sum(rep.causes_ms.values()) / rep.idle_ms:.2f}%"
                                        if rep.idle_ms > 0 else "-" for rep in reports])
    lines.append("idle ms (steps) and device busy by step kind:")
    for key, label in STEP_KINDS.items():
        row(f"  {label}", [f"{rep.kinds[key].idle_ms:.1f} ({rep.kinds[key].steps})" for rep in reports])
        row(f"  {label}: busy", [f"{100 * rep.kind_busy_fraction(key):.1f}%" for rep in reports])
    row("planner ms per step (timeline)", [f"{r.stats['planner_ms_per_step']:.3f}" for r in runs])
    # Schedule and prefill metadata of the steps that admitted requests, over the requests they admitted.
    row("admission us per admitted request: wall / CPU", [f"{rep.admission_us_per_request:.2f} / "
                                                         f"{rep.admission_cpu_us_per_request:.2f}" for rep in reports])
    row("apply ms per step: wall / CPU (planner thread)", [f"{r.stats['apply_ms_per_step']:.3f} / "
                                                           f"{r.stats['apply_cpu_ms_per_step']:.3f}" for r in runs])
    row("  the longest apply: wall / CPU", ["{:.2f} / {:.2f}".format(*_longest_apply(r.records)) for r in runs])
    row("output ms per step (timeline)", [f"{r.stats['output_ms_per_step']:.3f}" for r in runs])
    row("generate's texts decoded after its outputs, ms (texts)",
        [f"{r.stats['generate_detok_ms']:.1f} ({r.stats['generate_detok_texts']})" for r in runs])
    if any(rep.speculative.get("spec_decode_num_drafts") for rep in reports):
        spec = [rep.speculative for rep in reports]
        lines.append("speculative decoding (vLLM's counters):")
        row("  drafts / draft tokens", [f"{s['spec_decode_num_drafts']}/{s['spec_decode_num_draft_tokens']}"
                                        for s in spec])
        row("  accepted tokens", [str(s["spec_decode_num_accepted_tokens"]) for s in spec])
        row("  acceptance rate", [f"{s['spec_decode_acceptance_rate']:.3f}" for s in spec])
        row("  mean acceptance length", [f"{s['spec_decode_mean_acceptance_length']:.2f}" for s in spec])
        row("  emitted tokens per step", [f"{s['emitted_tokens_per_step']:.1f}" for s in spec])
        row("  reconcile ms per step (one step late)", [f"{s['reconcile_ms_per_step']:.3f}" for s in spec])
    return "\n".join(lines)


def _longest_apply(records: list) -> tuple[float, float]:
    """The longest apply of a step's tokens, wall and CPU ms (a step where many requests finish, typically); wall
    beyond CPU is the planner waiting, mostly for the GIL. The means are ``stats()``' ``apply_*ms_per_step``."""
    if not records:
        return 0.0, 0.0
    longest = max(records, key=lambda r: r.apply_end - r.wait_end)
    return (longest.apply_end - longest.wait_end) * 1e3, longest.apply_cpu_ms


def run_figures(run: ModeRun) -> dict[str, float]:
    """The figures of one run that ``--repeats`` summarises."""
    rep = run.report
    return {"device_busy": rep.busy_fraction, "steady_busy": rep.kind_busy_fraction("steady"),
            "planner_ms_per_step": run.stats["planner_ms_per_step"],
            "admission_cpu_us_per_request": rep.admission_cpu_us_per_request,
            "output_ms_per_step": run.stats["output_ms_per_step"]}


def median_run(runs: list[ModeRun]) -> ModeRun:
    """The run whose device busy fraction is the median (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r.report.busy_fraction)[(len(runs) - 1) // 2]


_REPEAT_LABELS = {"device_busy": "device busy", "steady_busy": "steady (the rest): busy",
                  "planner_ms_per_step": "planner ms per step", "admission_cpu_us_per_request":
                  "admission CPU us per admitted request", "output_ms_per_step": "output ms per step"}


def format_repeats(every: dict[str, list[ModeRun]]) -> str:
    """Median [min - max] of each figure over every run of each mode, a column per mode."""
    count = len(next(iter(every.values())))
    lines = [f"{f'over {count} runs of each mode: median [min - max]':<44}" + "".join(f" {m:>24}" for m in every)]
    figures = {mode: [run_figures(r) for r in runs] for mode, runs in every.items()}
    for key, label in _REPEAT_LABELS.items():
        scale, unit, digits = (100.0, "%", 1) if key.endswith("busy") else (1.0, "", 3)
        cells = []
        for mode_figures in figures.values():
            values = np.array([f[key] for f in mode_figures]) * scale
            cells.append(f"{np.median(values):.{digits}f}{unit} [{values.min():.{digits}f}-{values.max():.{digits}f}]")
        lines.append(f"  {label:<42}" + "".join(f" {c:>24}" for c in cells))
    return "\n".join(lines)


def _nvtx_line(overhead: MarkOverhead, per_step: float) -> str:
    off = overhead.disabled_ns - overhead.baseline_ns
    line = (f"NVTX: {per_step:.1f} ranges per step; a range costs {off:.0f} ns when off -> "
            f"{per_step * off / 1e3:.2f} us/step")
    if overhead.enabled_ns is not None:
        on = overhead.enabled_ns - overhead.baseline_ns
        line += f"; {on:.0f} ns when on without a profiler -> {per_step * on / 1e3:.2f} us/step"
    return line


def cmd_profile(args: argparse.Namespace) -> int:
    from asyncbatch.profiling.timeline_plot import plot_timeline

    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    if args.torch_profiler and args.repeats > 1:
        raise ValueError("--torch-profiler records one run: use it with --repeats 1")
    overhead = measure_mark_overhead(100_000)
    every: dict[str, list[ModeRun]] = {}
    for _ in range(args.repeats):  # interleaved: a slow spell of the machine falls on both modes
        for overlap in [False] if args.no_overlap else [True, False]:
            run = _run_mode(args, overlap, out_dir)
            every.setdefault(run.mode, []).append(run)
    runs = [median_run(mode_runs) for mode_runs in every.values()]
    first = runs[0]
    env = environment(first.backend, _engine_kwargs(args, True).get("sim"))
    same = all([o.token_ids for o in r.outputs] == [o.token_ids for o in first.outputs]
               for mode_runs in every.values() for r in mode_runs)
    sim = " (SIMULATED device: modelled step times, pseudo-tokens)" if first.simulated else ""
    arrivals = "all at once" if args.request_rate <= 0 else f"{args.request_rate:g} req/s Poisson"
    repeats = format_repeats(every) + "\n\n" if args.repeats > 1 else ""
    text = (f"asyncbatch profile on {first.backend}{sim}\nhardware: {env['hardware']}\ncommit: {env['commit']}\n"
            f"command: {env['command']}\nworkload: {args.num_requests} requests, prompts {args.prompt_len} tokens, "
            f"outputs {args.output_len} tokens (ignore_eos), greedy, {arrivals}\n\n{format_table(runs)}\n\n"
            f"{repeats}"
            f"identical tokens in every mode: {same}\n{_nvtx_line(overhead, first.ranges_per_step)}\n"
            f"NVTX during the measured runs: {'on' if args.nvtx or nvtx_enabled() else 'off'}")
    print(text)
    traces = {r.mode: r.trace_run() for r in runs}
    if args.trace:
        export_traces(traces, args.trace)
    if out_dir is None:
        return 0 if same else 1
    export_traces(traces, out_dir / "trace.json")
    plot_timeline({f"{r.mode} ({r.backend}{', simulated' if r.simulated else ''})": (r.records, r.report)
                   for r in runs}, out_dir / "timeline.png", args.window_start, args.window,
                  title=(f"asyncbatch timeline window: {first.backend}{sim}\n"
                         f"{env['hardware']}; commit {env['commit']}"))
    report = {"environment": env, "workload": {k: v for k, v in vars(args).items() if k != "func"},
              "identical_tokens": same,
              "nvtx": {"overhead": dataclasses.asdict(overhead), "ranges_per_step": first.ranges_per_step,
                       "ranges_by_name_per_step": first.ranges_by_name},
              "runs": {r.mode: r.to_dict() for r in runs},
              "repeats": {mode: [run_figures(r) for r in mode_runs] for mode, mode_runs in every.items()}}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(f"# Idle-gap report\n\n```\n{text}\n```\n\nFiles: `trace.json` (open in "
                                       "ui.perfetto.dev or chrome://tracing), `timeline.png`, `report.json`.\n")
    print(f"wrote {out_dir}/report.json, report.md, trace.json, timeline.png")
    return 0 if same else 1
