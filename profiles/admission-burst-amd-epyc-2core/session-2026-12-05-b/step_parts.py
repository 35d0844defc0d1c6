"""Function-level CPU split of one 64-into-192 admission step on the planner rig (medians over seeds)."""
import sys, gc, time, statistics
sys.path.insert(0, "scripts")
import bench_admission as ba
from asyncbatch.engine import admission, prefill_metadata, row_state, block_manager, scheduler as sch, step_metadata
acc = {}
on = [False]
def wrap(owner, name, key):
    orig = getattr(owner, name)
    def f(*a, **k):
        t = time.thread_time_ns(); r = orig(*a, **k)
        if on[0]: acc[key] = acc.get(key, 0) + time.thread_time_ns() - t
        return r
    setattr(owner, name, f)
wrap(admission.Admitter, "_apply", "apply"); wrap(admission.Admitter, "admit", "admit")
wrap(row_state.RowState, "admit_many", "admit_many"); wrap(block_manager.BlockManager, "allocate_admitted", "allocate")
wrap(step_metadata, "write_prefill", "write_prefill"); wrap(sch.Scheduler, "_schedule_decode", "decode")
wrap(step_metadata.StepMetadataWriter, "write", "write")
burst, decoding = int(sys.argv[1]), int(sys.argv[2])
res = {}
for seed in range(15):
    rig = ba.planner_rig(burst, decoding, seed)
    if decoding: rig.step()
    for r in rig.burst: rig.scheduler.add(r)
    (gc.collect() if len(sys.argv) < 4 else None); gc.freeze(); acc.clear(); on[0] = True
    t = time.thread_time_ns()
    plan = rig.scheduler.schedule(); meta = rig.writer.write(plan, rig.staging.next_buffer())
    acc["total"] = time.thread_time_ns() - t
    on[0] = False; gc.unfreeze()
    for k, v in acc.items(): res.setdefault(k, []).append(v)
for k, v in res.items(): print(f"{k:14s} {statistics.median(v)/1e3:8.1f} us  {statistics.median(v)/1e3/burst:6.2f} us/req")
