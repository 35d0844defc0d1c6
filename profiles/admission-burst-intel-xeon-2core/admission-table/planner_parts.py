import sys, gc, time, statistics
burst = int(sys.argv[1]); decoding = int(sys.argv[2]); warm = len(sys.argv) > 3
exec(open("prof.py").read().split("mode = sys.argv[1]")[0])
from asyncbatch.engine import admission, row_state, block_manager, prefill_metadata, step_metadata
acc = {}
def wrap(cls, name, label):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter_ns(); r = f(*a, **k); acc[label] = acc.get(label, 0) + time.perf_counter_ns() - t; return r
    setattr(cls, name, g)
wrap(admission.Admitter, "admit", "admit"); wrap(admission.Admitter, "_apply", "_apply")
wrap(block_manager.BlockManager, "allocate_rows", "allocate_rows"); wrap(row_state.RowState, "admit_many", "admit_many")
wrap(step_metadata.StepMetadataWriter, "write", "write")
prefill_metadata.write_prefill = (lambda f: (lambda *a, **k: (lambda t: (f(*a, **k), acc.__setitem__("write_prefill", acc.get("write_prefill",0)+time.perf_counter_ns()-t))[0])(time.perf_counter_ns())))(prefill_metadata.write_prefill)
step_metadata.write_prefill = prefill_metadata.write_prefill
res = []
for seed in range(9):
    s, w, st = setup(burst, decoding, seed)
    acc.clear()
    if not warm: gc.collect()
    gc.freeze()
    t = time.perf_counter_ns(); plan = s.schedule(); meta = w.write(plan, st.next_buffer()); acc["total"] = time.perf_counter_ns() - t
    gc.unfreeze()
    res.append(dict(acc))
for k in res[0]:
    print(f"{k:14} {statistics.median(r[k] for r in res)/1e3/burst:6.2f} us/req  ({statistics.median(r[k] for r in res)/1e3:7.1f} us)")
