"""The planner's per-step output appends keep the GIL: numpy releases it inside a scatter that casts, at any
size, and a planner that lets go of the GIL on the device's critical path waits for whichever thread took it
(``asyncbatch/engine/row_state.py``, ``_HISTORY``). ``GilWatch`` sees a release without a clock; its control is
the casting scatter itself, which must be seen to release, or these checks could not fail.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from in_process import ROOT, run_program

from asyncbatch.engine.row_state import RowState
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.profiling.gil_release import TRIES, GilWatch

ROWS = 256  # a decode step's rows: below numpy's size threshold for releasing the GIL in a plain scatter


@pytest.fixture
def state() -> RowState:
    return RowState(ROWS, 4 * TRIES)  # room for TRIES single appends and TRIES runs of 2


def test_the_watch_sees_a_casting_scatter_let_go_of_the_gil(state):
    rows = np.arange(ROWS, dtype=np.int64)
    tokens = np.arange(ROWS, dtype=np.int64)  # int64 into the int32 history: numpy casts inside the scatter
    with GilWatch() as watch:
        assert watch.first_release(lambda: state._history_flat.__setitem__(rows * state._stride, tokens))
        assert watch.let_go(lambda: state._history_flat[rows * state._stride]) == 0  # a gather of 256 keeps it


def test_appending_a_steps_outputs_keeps_the_gil(state):
    rng = np.random.default_rng(0)
    rows = rng.permutation(ROWS).astype(np.int64)
    tokens = rng.integers(0, 50_000, ROWS, dtype=np.int64)  # as the device's outputs come
    # A verify step's runs, 3 tokens a row: one scatter of rows x 3 ids. Numpy lets go of the GIL in any loop
    # of more than 500 elements, cast or not, so 64 rows here (256 x 3 would release it whatever the dtypes).
    spec_rows = rows[:64]
    runs = rng.integers(0, 50_000, (64, 3), dtype=np.int64)
    counts = np.full(64, 2, dtype=np.int64)
    with GilWatch() as watch:
        assert watch.let_go(lambda: state.append_outputs(rows, tokens)) == 0
        assert watch.let_go(lambda: state.append_runs(spec_rows, runs, counts)) == 0
    row = int(rows[0])  # and the appends landed: TRIES single ids, then TRIES runs of 2
    assert state.outputs(row) == [int(tokens[0])] * TRIES + [int(t) for t in runs[0, :2]] * TRIES


def test_the_scan_script_counts_each_planner_functions_releases_and_unwraps_them():
    schedule = Scheduler.__dict__["schedule"]
    done = run_program([sys.executable, str(ROOT / "scripts" / "gil_release_scan.py"), "--rows", "64",
                        "--output-len", "8"])
    assert done.returncode == 0, done.stderr[-3000:]
    table = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in done.stdout.splitlines()[2:]}
    assert table["RowState.append_outputs"] == [8, 0]  # one a step, and never a release
    assert table["Scheduler.schedule"][0] >= 8  # the 8 steps, and any pass that found nothing to run
    assert Scheduler.__dict__["schedule"] is schedule  # the wrappers are gone
