"""``scripts/bench_startup.py`` end to end on this tree: a server started, healthy and answering, and ``generate``
run to its exit, each timed; the JSON holds every run."""

from __future__ import annotations

import json
import sys

import pytest
from in_process import run_program

pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[serve]')")


@pytest.mark.slow
def test_the_startup_benchmark_times_a_server_and_a_generate_run(tmp_path):
    out = tmp_path / "startup.json"
    done = run_program([sys.executable, "scripts/bench_startup.py", "--repeat", "1", "--json", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    (run,) = runs["this"]
    assert set(runs) == {"this"}
    assert 0 < run["serve_health_s"] <= run["serve_first_answer_s"] and run["generate_s"] > 0
    assert "serve_health_s" in done.stdout and "generate_s" in done.stdout
