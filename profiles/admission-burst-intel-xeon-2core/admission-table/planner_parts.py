"""The planner's parts of one admission step (Scheduler.schedule + StepMetadataWriter.write), per admitted request,
medians over 9 seeds: ``Admitter.admit`` (of it ``Admitter._apply`` and ``RowState.admit_many``), ``write_prefill``,
the whole ``write`` and the whole step. The set-up is ``scripts/bench_admission.py``'s planner case
(``planner_rig``): 32-token prompts, prefix caching on, every row warmed up once.

    PYTHONPATH=<tree> python planner_parts.py 64 192      # 64 admitted beside 192 decoding, after gc.collect()
    PYTHONPATH=<tree> python planner_parts.py 256 0 w     # 256 at an idle scheduler, no collect (warm)
"""

import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from bench_admission import planner_rig

from asyncbatch.engine import admission, prefill_metadata, row_state, step_metadata


def main() -> None:
    burst, decoding, warm = int(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3
    acc: dict[str, int] = {}

    def timed(f, label):
        def g(*a, **k):
            t = time.perf_counter_ns()
            r = f(*a, **k)
            acc[label] = acc.get(label, 0) + time.perf_counter_ns() - t
            return r
        return g

    admission.Admitter.admit = timed(admission.Admitter.admit, "admit")
    admission.Admitter._apply = timed(admission.Admitter._apply, "_apply")
    row_state.RowState.admit_many = timed(row_state.RowState.admit_many, "admit_many")
    step_metadata.StepMetadataWriter.write = timed(step_metadata.StepMetadataWriter.write, "write")
    step_metadata.write_prefill = timed(prefill_metadata.write_prefill, "write_prefill")
    runs = []
    for seed in range(9):
        rig = planner_rig(burst, decoding, seed)
        scheduler, writer, staging = rig.scheduler, rig.writer, rig.staging
        for request in rig.burst:
            scheduler.add(request)
        acc.clear()
        if not warm:
            gc.collect()
        gc.freeze()
        t = time.perf_counter_ns()
        writer.write(scheduler.schedule(), staging.next_buffer())
        acc["total"] = time.perf_counter_ns() - t
        gc.unfreeze()
        runs.append(dict(acc))
    for k in runs[0]:
        us = statistics.median(r[k] for r in runs) / 1e3
        print(f"{k:14} {us / burst:6.2f} us/req  ({us:7.1f} us)")


if __name__ == "__main__":
    main()
