"""The serving benchmark's results document (JSON), its side-by-side tables, and the ratios between systems.

``comparisons`` gives, at each load point, the first system (asyncbatch when present) over every
other: output tokens/s (above 1 is better for the numerator), P99 TTFT and P99 TPOT (below 1 is
better). ``notes`` says in words what the numbers cannot: which peer could not take token-id prompts
or ``ignore_eos``, whether the servers counted the same prompt tokens, which figures are simulated.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
from pathlib import Path

from asyncbatch.bench.report import command_line, machine_info, write_json
from asyncbatch.bench.schema import SERVING_SCHEMA, SERVING_SCHEMA_ID
from asyncbatch.profiling.host_info import git_commit

_VERSIONS = ("httpx", "fastapi", "uvicorn", "openai", "prometheus_client")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _p99(summary: dict, key: str) -> float | None:
    dist = summary.get(key)
    return None if not dist else dist["p99"]


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def comparisons(systems: list[dict]) -> list[dict]:
    """The first system over each other one at every load point they share."""
    if len(systems) < 2:
        return []
    first, out = systems[0], []
    for other in systems[1:]:
        theirs = {p["load"]["label"]: p["summary"] for p in other["points"]}
        for point in first["points"]:
            label = point["load"]["label"]
            if label not in theirs:
                continue
            a, b = point["summary"], theirs[label]
            out.append({"load": label, "numerator": first["name"], "denominator": other["name"],
                        "output_throughput_ratio": _ratio(a["output_throughput"], b["output_throughput"]),
                        "goodput_ratio": _ratio(a["goodput"], b["goodput"]),
                        "p99_ttft_ratio": _ratio(_p99(a, "ttft_ms"), _p99(b, "ttft_ms")),
                        "p99_tpot_ratio": _ratio(_p99(a, "tpot_ms"), _p99(b, "tpot_ms"))})
    return out


def prompt_token_agreement(systems: list[dict]) -> dict | None:
    """Do the servers report the same prompt tokens for the same requests? (Text prompts are tokenized by
    each server; the same tokenizer must give the same counts.)"""
    if len(systems) < 2:
        return None
    counts = [{(p["load"]["label"], r["index"]): r["prompt_tokens"] for p in s["points"] for r in p["requests"]
               if r["success"] and r["prompt_tokens"] is not None} for s in systems]
    shared = set(counts[0]).intersection(*counts[1:])
    same = sum(all(c[key] == counts[0][key] for c in counts[1:]) for key in shared)
    return {"compared": len(shared), "identical": same}


def build_document(settings: dict, workload: dict, loads: list[dict], systems: list[dict],
                   notes: list[str]) -> dict:
    doc = {
        "schema": SERVING_SCHEMA_ID,
        "kind": "serving",
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "git_commit": git_commit(mark_dirty=True),
        "machine": {**machine_info(settings["device"]), "packages": package_versions()},
        "settings": settings,
        "workload": workload,
        "loads": loads,
        "systems": systems,
        "comparisons": comparisons(systems),
        "prompt_tokens_agreement": prompt_token_agreement(systems),
        "notes": list(notes),
        "plots": [],
    }
    agreement = doc["prompt_tokens_agreement"]
    if agreement and agreement["compared"]:
        doc["notes"].append(f"prompt tokens reported by the servers: identical for {agreement['identical']} of "
                            f"{agreement['compared']} requests")
    return doc


def write_serving_json(doc: dict, path: Path) -> Path:
    """The serving document, validated against ``SERVING_SCHEMA``, as ``path``."""
    return write_json(doc, path, SERVING_SCHEMA, "serving results")


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _dist(summary: dict, key: str, stats: tuple[str, ...], digits: int = 0) -> str:
    d = summary.get(key)
    return " / ".join(_f(None if not d else d[s], digits) for s in stats)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _busy(point: dict) -> str:
    server = point["server"]
    if not server.get("available"):
        return "-"
    busy = server.get("device_busy_fraction")
    running = ((server.get("gauges") or {}).get("running") or {}).get("max")
    text = _f(None if busy is None else 100 * busy)
    return text if running is None else f"{text} (max {running:.0f} running)"


def markdown_tables(doc: dict) -> str:
    """Per load point, one row per system side by side; then the ratios."""
    header = ("| load | system | ok / sent | req/s | output tok/s | goodput req/s | TTFT mean / p50 / p90 / p99 (ms) "
              "| TPOT mean / p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) | E2E p50 / p99 (ms) | device busy % "
              "| output tok per server CPU-s | CPU taken by others |")
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    by_load: dict[str, list[tuple[str, dict]]] = {}
    for system in doc["systems"]:
        for point in system["points"]:
            by_load.setdefault(point["load"]["label"], []).append((system["name"], point))
    for label, entries in by_load.items():
        for name, point in entries:
            s = point["summary"]
            rows.append(
                f"| {label} | {name} | {s['completed']} / {s['num_requests']} | {_f(s['request_throughput'], 2)} | "
                f"**{_f(s['output_throughput'])}** | {_f(s['goodput'], 2)} | "
                f"{_dist(s, 'ttft_ms', ('mean', 'p50', 'p90', 'p99'))} | "
                f"{_dist(s, 'tpot_ms', ('mean', 'p50', 'p90', 'p99'), 1)} | "
                f"{_dist(s, 'itl_ms', ('p50', 'p99'), 1)} | {_dist(s, 'e2e_ms', ('p50', 'p99'))} | {_busy(point)} | "
                f"{_f(point['host'].get('output_tokens_per_server_cpu_s'))} | {_pct(point['host'].get('contention'))} |")
    out = "\n".join(rows)
    if doc["comparisons"]:
        ratio_rows = ["| load | ratio | output tok/s | goodput | P99 TTFT | P99 TPOT |", "|---|---|---|---|---|---|"]
        for c in doc["comparisons"]:
            ratio_rows.append(f"| {c['load']} | {c['numerator']} / {c['denominator']} | "
                              f"{_x(c['output_throughput_ratio'])} | {_x(c['goodput_ratio'])} | "
                              f"{_x(c['p99_ttft_ratio'])} | {_x(c['p99_tpot_ratio'])} |")
        out += "\n\n" + "\n".join(ratio_rows)
    return out


def markdown_report(doc: dict) -> str:
    """What was measured where (machine, model, load), the tables, and the notes."""
    m, st, w = doc["machine"], doc["settings"], doc["workload"]
    simulated = " (**simulated** device)" if st["device"] == "sim" else ""
    slo = ", ".join(f"{k.split('_')[0].upper()} <= {v:g} ms" for k, v in st["slo"].items() if v is not None)
    machine = (f"Machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, transformers {m['transformers']}; "
               f"device {st['device']}{simulated}, {st['dtype']}; model `{Path(st['model_path']).name}`.")
    load = (f"Workload: {w['name']}, {st['num_prompts']} requests per load point ({st['prompt_format']} prompts, "
            f"{'ignore EOS' if st['ignore_eos'] else 'EOS honoured'}, temperature {st['temperature']:g}); "
            f"goodput SLO: {slo or 'none'}. Commit {doc['git_commit']}, {doc['created_utc']}.")
    lines = [machine, load, "", markdown_tables(doc)]
    if doc["notes"]:
        lines += ["", *(f"- {n}" for n in doc["notes"])]
    return "\n".join(lines)


def terminal_table(doc: dict) -> str:
    head = (f"{'load':<24} {'system':<13} {'ok/sent':>9} {'req/s':>6} {'out tok/s':>9} {'goodput':>7} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>8} {'TPOT p99':>8} {'ITL p50':>8} {'E2E p99':>9} "
            f"{'busy%':>6} {'others%':>7}")
    lines = [head, "-" * len(head)]
    for system in doc["systems"]:
        for point in system["points"]:
            s = point["summary"]
            ttft, tpot, itl, e2e = (s.get(k) or {} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
            busy = point["server"].get("device_busy_fraction") if point["server"].get("available") else None
            lines.append(
                f"{point['load']['label']:<24} {system['name']:<13} {s['completed']:>4}/{s['num_requests']:<4} "
                f"{s['request_throughput']:>6.2f} {s['output_throughput']:>9.1f} {s['goodput']:>7.2f} "
                f"{_f(ttft.get('p50'), 0):>9} {_f(ttft.get('p99'), 0):>9} {_f(tpot.get('p50')):>8} "
                f"{_f(tpot.get('p99')):>8} {_f(itl.get('p50')):>8} {_f(e2e.get('p99'), 0):>9} "
                f"{_f(None if busy is None else 100 * busy):>6} {_pct(point['host'].get('contention')):>7}")
    for c in doc["comparisons"]:
        lines.append(f"{c['numerator']} / {c['denominator']} at {c['load']}: output tok/s "
                     f"{_x(c['output_throughput_ratio'])}, P99 TTFT {_x(c['p99_ttft_ratio'])}, "
                     f"P99 TPOT {_x(c['p99_tpot_ratio'])}")
    lines += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(lines)
