"""The offline results document (JSON), its tables, and asyncbatch overlap's ratios over the other systems."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from asyncbatch.bench.metrics import median_of, spread
from asyncbatch.bench.report import command_line, machine_info, write_json
from asyncbatch.profiling.host_info import git_commit
from harness.results_schema import RESULTS_SCHEMA, SCHEMA_ID
from harness.runner import SystemData, rate_key
from harness.systems import GENERATE_BATCH, LLAMACPP, OVERLAP, STATIC, SYNC


def comparisons(results: list[SystemData], rates: list[float | None]) -> list[dict]:
    """asyncbatch overlap's median output throughput over each other system's, at each rate."""
    by_name = {r.name: r for r in results}
    if OVERLAP not in by_name:
        return []
    out = []
    for rate in rates:
        num = _median_tput(by_name[OVERLAP], rate)
        for other in (GENERATE_BATCH, SYNC, STATIC, LLAMACPP):
            if other in by_name and num:
                den = _median_tput(by_name[other], rate)
                if den:
                    out.append({"request_rate": rate_key(rate), "numerator": OVERLAP, "denominator": other,
                                "output_throughput_ratio": num / den})
    return out


def _median_tput(data: SystemData, rate: float | None) -> float | None:
    s = spread([m["output_throughput"] for m in data.points[rate].metrics])
    return None if s is None else s["median"]


def build_document(kind: str, settings: dict, workload: dict, results: list[SystemData],
                   rates: list[float | None], correctness: dict | None) -> dict:
    return {
        "schema": SCHEMA_ID,
        "kind": kind,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "git_commit": git_commit(),
        "machine": machine_info(settings.get("device", "cpu")),
        "settings": settings,
        "workload": workload,
        "request_rates": [rate_key(r) for r in rates],
        "systems": [{"name": r.name, "description": r.description, "config": r.config, "load_mib": r.load_mib,
                     "points": [p.as_dict(rate) for rate, p in r.points.items()]} for r in results],
        "correctness": correctness,
        "comparisons": comparisons(results, rates),
        "plots": [],
    }


def write_results(doc: dict, results_dir: Path, name: str) -> Path:
    """The document, validated against ``RESULTS_SCHEMA``, as ``results_dir/name``."""
    return write_json(doc, results_dir / name, RESULTS_SCHEMA, "benchmark results")


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cells(system: dict, point: dict) -> dict[str, str]:
    """A system's figures at one rate, formatted once for both tables (medians over repeats)."""
    s = point["summary"]
    out = s["output_throughput"]
    busy = median_of(s, "engine", "device_busy_fraction")
    return {
        "system": system["name"],
        "rate": "offline" if point["request_rate"] is None else str(point["request_rate"]),
        "out": f"{out['median']:.1f}", "out_range": f"({out['min']:.1f}-{out['max']:.1f})",
        "req_s": _fmt(median_of(s, "request_throughput"), 2),
        "total": _fmt(median_of(s, "total_token_throughput")),
        "ttft50": _fmt(median_of(s, "ttft_ms", "p50"), 0), "ttft99": _fmt(median_of(s, "ttft_ms", "p99"), 0),
        "tpot50": _fmt(median_of(s, "tpot_ms", "p50")), "tpot99": _fmt(median_of(s, "tpot_ms", "p99")),
        "itl50": _fmt(median_of(s, "itl_ms", "p50")), "e2e50": _fmt(median_of(s, "e2e_ms", "p50"), 0),
        "busy": _fmt(None if busy is None else 100 * busy),
        "plan": _fmt(median_of(s, "engine", "planner_ms_per_step"), 2),
        "mem": _fmt(median_of(s, "peak_memory_mib"), 0),
        "per_cpu": _fmt(median_of(s, "output_tokens_per_cpu_s")),
        "others": _fmt(_pct(median_of(s, "contention")), 0),
    }


def table(doc: dict) -> str:
    """One row per system and request rate: medians over repeats, output tok/s with its min-max."""
    head = (f"{'system':<28} {'rate':>6} {'req/s':>7} {'out tok/s (min-max)':>24} {'total tok/s':>11} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'E2E p50':>9} "
            f"{'busy%':>6} {'plan ms':>7} {'mem MiB':>8} {'tok/CPU-s':>9} {'others%':>7}")
    lines = [head, "-" * len(head)]
    for system in doc["systems"]:
        for point in system["points"]:
            c = _cells(system, point)
            tput = f"{c['out']} {c['out_range']}"
            lines.append(
                f"{c['system']:<28} {c['rate']:>6} {c['req_s']:>7} {tput:>24} {c['total']:>11} "
                f"{c['ttft50']:>9} {c['ttft99']:>9} {c['tpot50']:>9} {c['tpot99']:>9} {c['itl50']:>8} "
                f"{c['e2e50']:>9} {c['busy']:>6} {c['plan']:>7} {c['mem']:>8} {c['per_cpu']:>9} {c['others']:>7}")
    for c in doc["comparisons"]:
        rate = "offline" if c["request_rate"] is None else f"rate {c['request_rate']}"
        lines.append(f"{c['numerator']} / {c['denominator']} ({rate}): {c['output_throughput_ratio']:.2f}x "
                     "output tokens/s (medians)")
    corr = doc.get("correctness")
    if corr:
        for name, r in corr["results"].items():
            lines.append(f"tokens vs {corr['reference']}: {name}: {r['identical']}/{r['compared']} requests "
                         f"identical, mean common prefix {100 * r['mean_common_prefix_fraction']:.1f}%")
    return "\n".join(lines)


def markdown_table(doc: dict) -> str:
    """The headline numbers as a Markdown table (medians over repeats; min-max for throughput)."""
    header = ("| system | rate (req/s) | output tok/s (min-max) | total tok/s | req/s | TTFT p50 / p99 (ms) | "
              "TPOT p50 / p99 (ms) | device busy % | planner ms/step | peak MiB | output tok/CPU-s | "
              "CPU taken by others |")
    rows = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system in doc["systems"]:
        for point in system["points"]:
            c = _cells(system, point)
            rows.append(
                f"| {c['system']} | {c['rate']} | **{c['out']}** {c['out_range']} | {c['total']} | {c['req_s']} | "
                f"{c['ttft50']} / {c['ttft99']} | {c['tpot50']} / {c['tpot99']} | {c['busy']} | {c['plan']} | "
                f"{c['mem']} | {c['per_cpu']} | {c['others']}% |")
    return "\n".join(rows)
