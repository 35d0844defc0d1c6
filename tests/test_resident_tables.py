"""The planner's per-row tables are resident from construction (``RowState.history``, ``BlockManager.block_table``).

Lazily mapped (``np.zeros``), their pages were faulted in by the first outputs and block tables of rows that
had never held a request: in ``apply`` and admission, on the planner's critical path, 0.2-5 ms per 2 MiB huge
page on the 2-core VMs, which put 1,024 running on ``sim`` at 0.81-0.83 busy in the runs that got fresh
memory (profiles/admission-burst-intel-xeon-2core). ``mincore`` reports which pages are in memory; the
admission step's own page faults are counted with ``getrusage``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import resource
import sys

import numpy as np
import pytest

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and RUSAGE_THREAD: Linux")

ROWS, MAX_MODEL_LEN, BLOCK = 1024, 8192, 16


def _resident_fraction(array: np.ndarray) -> float:
    """Fraction of the pages under ``array``'s bytes that are in memory (``mincore``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    pages = (array.ctypes.data + array.nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        pytest.fail(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(v & 1 for v in vec) / pages


def _planner() -> tuple[Scheduler, StepMetadataWriter, StagingPair]:
    blocks = BlockManager(ROWS * 3 + 1, BLOCK, ROWS, MAX_MODEL_LEN // BLOCK, prefix_caching=True)
    scheduler = Scheduler(blocks, 8192, eos_token_id=2)
    return scheduler, StepMetadataWriter(scheduler.rows, blocks), StagingPair(8192, ROWS, MAX_MODEL_LEN // BLOCK,
                                                                             pinned=False)


def test_admitting_into_unused_rows_faults_in_few_pages() -> None:
    """256 requests into rows no request has held: the step's page faults are its temporaries' (72 here), not
    one or more per row (the lazily mapped tables gave ~390). First in the file: memory that an earlier test
    freed can come back already resident and hide a lazily mapped table from this count (not from
    ``mincore``, below)."""
    scheduler, writer, staging = _planner()
    rng = np.random.default_rng(0)

    def step():
        plan = scheduler.schedule()
        meta = writer.write(plan, staging.next_buffer())
        scheduler.release_drained(plan)
        scheduler.apply(plan, np.full(meta.num_sampled, 7), np.ones(meta.num_sampled, dtype=bool))
        return plan

    params = SamplingParams(max_tokens=400, ignore_eos=True)
    for i in range(4):  # the code paths warmed on four rows
        scheduler.add(Request(f"w{i}", i, rng.integers(256, 30000, 32).tolist(), params, i, 0.0))
    step()
    for i in range(256):
        scheduler.add(Request(str(i), 100 + i, rng.integers(256, 30000, 32).tolist(), params, i, 0.0))
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    plan = step()
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert plan.num_admitted == 256
    assert faults < 256, f"{faults} page faults admitting 256 requests: a per-row table is mapped lazily again"
    scheduler.check_integrity()


def test_row_and_block_tables_are_resident_from_construction() -> None:
    scheduler, _, _ = _planner()
    assert scheduler.rows.history.nbytes > 32 << 20  # 1,024 rows x 8,192 outputs: large enough to matter
    assert _resident_fraction(scheduler.rows.history) == 1.0
    assert _resident_fraction(scheduler.blocks.block_table) == 1.0
    assert not scheduler.rows.history.any() and not scheduler.blocks.block_table.any()  # still zeros
