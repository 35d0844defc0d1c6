"""Smoke test of scripts/bench_host.py: the quick run on this tree writes a complete, sane report.

Only the shape and ranges of the numbers are checked, never their speed: the figures depend on the
machine and on whatever else runs on it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from in_process import run_program

ROOT = Path(__file__).resolve().parents[1]
SIM_SECTIONS = ("planner", "busy", "gil")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fraction(value: object) -> bool:
    # Busy is device time over the span it covers; back-to-back steps may round a hair above 1.
    return _finite(value) and 0.0 <= value <= 1.0 + 1e-9


def _check_sim_row(section: str, key: str, metrics: dict) -> None:
    where = f"{section} / {key}"
    assert metrics["steps"] > 0 and metrics["window_steps"] > 0, where
    assert metrics["output_tokens"] > 0 and metrics["wall_tok_s"] > 0, where
    assert _fraction(metrics["busy_window"]) and _fraction(metrics["busy_run"]), where
    for name in ("crit_ms_p50", "crit_ms_p90", "planner_ms_p50", "apply_ms_p50", "idle_gap_ms_mean"):
        assert _finite(metrics[name]) and metrics[name] >= 0, f"{where}: {name}={metrics[name]}"
    assert metrics["crit_ms_p90"] >= metrics["crit_ms_p50"], where


@pytest.mark.slow
def test_quick_report_is_complete(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = run_program([sys.executable, str(ROOT / "scripts" / "bench_host.py"), "--quick", "--skip-cpu",
                        "--out", str(out)])  # in the test worker: tests/in_process.py says why
    assert proc.returncode == 0, f"bench_host failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "simulated device" in (out / "report.md").read_text()
    report = json.loads((out / "report.json").read_text())

    machine = report["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and machine["torch"] and machine["numpy"]
    assert report["revisions"]["after"]["commit"]
    assert "before" not in report["revisions"]
    assert set(report["sections"]) == set(SIM_SECTIONS)

    for name in SIM_SECTIONS:
        section = report["sections"][name]
        assert section["simulated"] is True and "after_error" not in section
        assert section["rows"], name
        for row in section["rows"]:
            assert row["before"] is None
            assert row["after"]["config"]["process_mode"] in ("in-process", "child process")
            _check_sim_row(name, row["key"], row["after"]["metrics"])

    gil_rows = [row["after"] for row in report["sections"]["gil"]["rows"]]
    assert {row["config"]["hog"] for row in gil_rows} == {False, True}
    assert all(row["metrics"]["hog_loops_per_s"] > 0 for row in gil_rows if row["config"]["hog"])
    assert report["goals"] and all(goal["after"] in (True, False) for goal in report["goals"])
