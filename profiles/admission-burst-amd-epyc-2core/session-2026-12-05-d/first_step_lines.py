"""Why a burst's first admitting step costs more than its second, line by line (line_profiler), on the engine-sized
rig of ``rig_first_burst.py``: nine bursts of 256 (32-token prompts, 400 outputs) on one thread; the first and the
second admitting step of bursts 1-8 are profiled apart. Prints the lines whose time differs most, per step.

    python profiles/admission-burst-amd-epyc-2core/session-2026-12-05-d/first_step_lines.py
"""
import gc
import io
import re
import sys

import numpy as np
from line_profiler import LineProfiler

sys.path.insert(0, "scripts")
from bench_admission import PlannerRig

from asyncbatch.engine import admission, block_manager, prefill_metadata, row_state
from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.core import planner_writer
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.sampling_params import SamplingParams

funcs = [admission.Admitter.admit, admission.Admitter._apply, prefill_metadata.write_prefill,
         row_state.RowState.admit_many, block_manager.BlockManager.allocate_admitted]
profilers = {"first": LineProfiler(*funcs), "second": LineProfiler(*funcs)}
rows, budget = 256, 2048
blocks = BlockManager(46602, 16, rows, 512, prefix_caching=True)
sch = Scheduler(blocks, budget, eos_token_id=2)
rig = PlannerRig(sch, planner_writer(sch, 49152), StagingPair(budget, rows, 512, pinned=False), [],
                 np.full(rows, 7, dtype=np.int64), np.ones(rows, dtype=bool))
rng = np.random.default_rng(0)
gc.collect()
gc.freeze()
seq = 0
bursts = 9
for burst in range(bursts):
    for _ in range(256):
        seq += 1
        sch.add(Request(str(seq), seq, rng.integers(256, 30000, 32).tolist(),
                        SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), seq, 0.0))
    k = 0
    while sch.has_work():
        prof = profilers["first" if k == 0 else "second"] if burst and sch.waiting and k < 2 else None
        if prof:
            prof.enable()
        plan = sch.schedule()
        meta = rig.writer.write(plan, rig.staging.next_buffer())
        if prof:
            prof.disable()
        sch.release_drained(plan)
        rig.apply(plan, meta)
        k += plan.num_admitted > 0
    sch.settle_released()


def lines(profiler: LineProfiler) -> dict:
    out = io.StringIO()
    profiler.print_stats(stream=out, output_unit=1e-6)
    table, function = {}, None
    for line in out.getvalue().splitlines():
        if m := re.match(r"Function: (\S+)", line):
            function = m.group(1)
        elif (m := re.match(r"\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(.*)", line)) and function:
            table[(function, int(m.group(1)))] = (float(m.group(3)) / (bursts - 1), m.group(6).strip())
    return table


first, second = lines(profilers["first"]), lines(profilers["second"])
print("us a step under line_profiler (nested calls count in their caller's line too): first admitting step of a burst"
      f" {sum(t for (f, _), (t, _) in first.items() if f == 'Admitter.admit'):.0f} in admit,"
      f" second {sum(t for (f, _), (t, _) in second.items() if f == 'Admitter.admit'):.0f}")
print(f"{'first':>7} {'second':>7}  line")
for key, (t, src) in sorted(first.items(), key=lambda kv: -(kv[1][0] - second.get(kv[0], (0.0, ""))[0]))[:20]:
    print(f"{t:7.1f} {second.get(key, (0.0, ''))[0]:7.1f}  {key[0]}:{key[1]}  {src[:80]}")
