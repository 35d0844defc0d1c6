"""PNG plots from a results document: throughput per system, latency CDFs, throughput versus rate, and
(serving documents) latency versus load.

Plots read only the document (medians, min-max spreads and the stored CDF
quantiles), so they can be redrawn from a JSON file alone. The Agg backend
needs no display.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend must be chosen before this import
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

_COLORS = {"asyncbatch-overlap": "#1f77b4", "asyncbatch-sync": "#7fb2de",
           "transformers-generate_batch": "#d62728", "transformers-static": "#ff9f40",
           "asyncbatch": "#1f77b4", "transformers": "#d62728"}
_CDF_METRICS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                ("e2e_ms", "end-to-end latency (ms)"))


def _subtitle(doc: dict) -> str:
    m, s, w = doc["machine"], doc["settings"], doc["workload"]
    model = Path(str(s.get("model_path") or s.get("model") or "default")).name
    return (f"{model}, {s['dtype']}, {m['device']} ({m['cores']} cores), workload {w['name']} "
            f"x{w['num_requests']}, {s['repeats']} repeat{'s' if s['repeats'] != 1 else ''}")


def _save(fig, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_bars(doc: dict, path: Path, rate: object = None) -> Path:
    """Median output tokens per second and per CPU-second for each system at ``rate`` (None: offline),
    whiskers at min and max over repeats."""
    panels = (("output_throughput", "output tokens/s (wall clock)"),
              ("output_tokens_per_cpu_s", "output tokens per CPU-second"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, (key, label) in zip(axes, panels):
        names, med, lo, hi = [], [], [], []
        for system in doc["systems"]:
            point = next((p for p in system["points"] if p["request_rate"] == rate), None)
            s = None if point is None else point["summary"].get(key)
            if s is None:
                continue
            names.append(system["name"])
            med.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        bars = ax.bar(range(len(names)), med, yerr=[lo, hi], capsize=6,
                      color=[_COLORS.get(n, "#888888") for n in names])
        for bar, value, up in zip(bars, med, hi):
            ax.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value + up), ha="center",
                        va="bottom", xytext=(0, 4), textcoords="offset points", fontsize=9)
        ax.set_xticks(range(len(names)), [n.replace("-", "\n", 1) for n in names], fontsize=9)
        ax.set_ylabel(label + "\n(median, whiskers min-max)")
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
    where = "offline" if rate is None else f"at {rate} req/s"
    return _save(fig, path, f"Throughput ({where}) - {_subtitle(doc)}")


def latency_cdfs(doc: dict, path: Path, rate: object = None) -> Path:
    """Empirical CDFs (pooled over repeats) of TTFT, TPOT, ITL and E2E at ``rate``; empty metrics skipped."""
    shown = [(key, label) for key, label in _CDF_METRICS
             if any(p["cdf"].get(key) for s in doc["systems"] for p in s["points"] if p["request_rate"] == rate)]
    fig, axes = plt.subplots(1, max(len(shown), 1), figsize=(4.2 * max(len(shown), 1), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], shown):
        for system in doc["systems"]:
            point = next((p for p in system["points"] if p["request_rate"] == rate), None)
            q = None if point is None else point["cdf"].get(key)
            if not q:
                continue
            ys = [i / (len(q) - 1) for i in range(len(q))]
            ax.plot(q, ys, label=system["name"], color=_COLORS.get(system["name"]))
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of " + ("gaps" if key == "itl_ms" else "requests"))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower right")
    where = "offline" if rate is None else f"{rate} req/s"
    return _save(fig, path, f"Latency CDFs ({where}) - {_subtitle(doc)}")


def throughput_vs_rate(doc: dict, path: Path) -> Path:
    """Output tokens/s and median TTFT against request rate ("inf" drawn at the right edge)."""
    finite = [r for r in doc["request_rates"] if isinstance(r, (int, float))]
    inf_x = (max(finite) * 2 if finite else 1.0)

    def x_of(rate: object) -> float:
        return inf_x if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else float(rate)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for system in doc["systems"]:
        pts = sorted((x_of(p["request_rate"]), p["summary"]) for p in system["points"]
                     if p["request_rate"] is not None)
        if not pts:
            continue
        xs = [x for x, _ in pts]
        tput = [s["output_throughput"] for _, s in pts]
        color = _COLORS.get(system["name"])
        ax1.errorbar(xs, [t["median"] for t in tput], yerr=[[t["median"] - t["min"] for t in tput],
                                                            [t["max"] - t["median"] for t in tput]],
                     marker="o", capsize=4, label=system["name"], color=color)
        ttft = [(x, s["ttft_ms"]["p50"]["median"]) for x, s in pts if s.get("ttft_ms")]
        ax2.plot([x for x, _ in ttft], [v for _, v in ttft], marker="o", label=system["name"], color=color)
    ticks = sorted({x_of(r) for r in doc["request_rates"] if r is not None})
    labels = ["inf" if x == inf_x and "inf" in doc["request_rates"] else f"{x:g}" for x in ticks]
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(ticks, labels)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("request rate (req/s; inf = all at once)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("output tokens/s (median, min-max)")
    ax2.set_ylabel("TTFT p50 (ms, median of repeats)")
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    return _save(fig, path, f"Throughput and TTFT versus request rate - {_subtitle(doc)}")


def _load_axis(loads: list[dict]) -> tuple[str, list[float], list[str], dict[str, float]]:
    """x label, ticks, tick labels and each load label's x: the request rate ("inf" at the right edge),
    or the concurrency cap when the rate is the same at every point and only the cap varies."""
    rates = [load["request_rate"] for load in loads]
    caps = [load["max_concurrency"] for load in loads]
    if len(set(map(str, rates))) == 1 and len(set(caps)) > 1 and None not in caps:
        xs = {load["label"]: float(load["max_concurrency"]) for load in loads}
        return "max concurrency (requests in flight)", sorted(set(xs.values())), [f"{x:g}" for x in
                                                                                 sorted(set(xs.values()))], xs
    finite = [r for r in rates if isinstance(r, (int, float))]
    inf_x = max(finite) * 2 if finite else 1.0
    xs = {load["label"]: inf_x if load["request_rate"] == "inf" else float(load["request_rate"]) for load in loads}
    ticks = sorted(set(xs.values()))
    labels = ["inf" if x == inf_x and "inf" in rates else f"{x:g}" for x in ticks]
    return "request rate (req/s; inf = all at once)", ticks, labels, xs


def latency_vs_load(doc: dict, path: Path) -> Path:
    """A serving document's P50 (dashed) and P99 (solid) TTFT and TPOT, and output tokens/s, per system
    against the offered load."""
    xlabel, ticks, labels, xs = _load_axis(doc["loads"])
    panels = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("output_throughput", "output tokens/s"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, system in enumerate(doc["systems"]):
        color = _COLORS.get(system["name"], palette[i % len(palette)])  # P50 and P99 of a system share it
        pts = sorted((xs[p["load"]["label"]], p["summary"]) for p in system["points"])
        for ax, (key, _label) in zip(axes, panels):
            if key == "output_throughput":
                ax.plot([x for x, _ in pts], [s[key] for _, s in pts], marker="o", color=color,
                        label=system["name"])
                continue
            for stat, style in (("p50", "--"), ("p99", "-")):
                vals = [(x, s[key][stat]) for x, s in pts if s.get(key)]
                ax.plot([x for x, _ in vals], [v for _, v in vals], style, marker="o", color=color,
                        label=f"{system['name']} {stat.upper()}")
    for ax, (key, label) in zip(axes, panels):
        ax.set_xscale("log")
        ax.set_xticks(ticks, labels)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        # A log axis needs a positive value (a run of one-token outputs has TPOT 0 everywhere).
        if key != "output_throughput" and any(v > 0 for line in ax.get_lines() for v in line.get_ydata()):
            ax.set_yscale("log")  # light load to overload spans decades
            plain = FuncFormatter(lambda v, _pos: f"{v:g}")
            low, high = ax.get_ylim()
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 100, 200, 500, 1000, ...
            ax.yaxis.set_major_formatter(plain)
            # A narrow range may hold no 1-2-5 tick at all: label the minor ones then.
            ax.yaxis.set_minor_formatter(plain if high < 3 * low else NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    m, s, w = doc["machine"], doc["settings"], doc["workload"]
    model = Path(str(s.get("model_path") or "default")).name
    simulated = " (SIMULATED device)" if s["device"] == "sim" else ""
    title = (f"Serving latency versus load - {model}, {s['dtype']}, {s['device']}{simulated}, {m['cpu']} "
             f"({m['cores']} cores), {w['name']} x{s['num_prompts']} per point")
    return _save(fig, path, title)
