"""PNG plots from a results document: throughput per system, latency CDFs, throughput versus rate.

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
from matplotlib.ticker import NullLocator

_COLORS = {"asyncbatch-overlap": "#1f77b4", "asyncbatch-sync": "#7fb2de",
           "transformers-generate_batch": "#d62728", "transformers-static": "#ff9f40"}
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
