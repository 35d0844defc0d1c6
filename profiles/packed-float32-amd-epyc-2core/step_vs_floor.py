"""One process, the step of one row beside the read bandwidth measured between its rounds (float32 with the
packed weights, then bfloat16): the ratio to the memory floor without bench_lean_step.py's two interleaved
children. python profiles/packed-float32-amd-epyc-2core/step_vs_floor.py"""
import sys, torch, statistics, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"))
from harness.decode_step import DecodeStepBench
torch.set_num_threads(2)
a = torch.ones(128 << 20)
def bw():
    best = min((lambda t0: (a.sum(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
    return a.numel() * 4 / best
for dt in ("float32", "bfloat16"):
    b = DecodeStepBench(dtype=dt)
    steps, bws = [], []
    for r in range(6):
        bws.append(bw()); steps.append(b.time_steps(1, repeats=8).median_ms)
    floor = b.weight_bytes() / statistics.median(bws) * 1e3
    print(dt, "steps", [round(s, 1) for s in steps], "GB/s", [round(x / 1e9, 1) for x in bws],
          f"median step {statistics.median(steps):.1f} ms, floor {floor:.1f} ms -> {statistics.median(steps) / floor:.2f}x")
    del b
