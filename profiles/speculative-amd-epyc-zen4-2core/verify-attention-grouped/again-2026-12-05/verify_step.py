import sys, time, statistics, dataclasses, torch
sys.path.insert(0, "scripts")
from harness.decode_step import DecodeStepBench, BLOCK_SIZE
from asyncbatch.model.forward_batch import ForwardBatch
dtype, quant, ctx = sys.argv[1], (None if sys.argv[2] == "none" else sys.argv[2]), int(sys.argv[3])
W = 4
bench = DecodeStepBench(dtype=dtype, quantization=quant, max_rows=2, context=ctx + W, threads=2)
per_row = -(-(ctx + W) // BLOCK_SIZE)
tables = (1 + torch.arange(per_row)).view(1, -1).repeat_interleave(W, 0)
pos = torch.arange(ctx - 1, ctx - 1 + W)
slot = tables[0, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
base = ForwardBatch(torch.randint(0, 1000, (W,)), pos, slot, W, tables, pos + 1, [], torch.arange(W))
batches = {1: base, W: dataclasses.replace(base, decode_width=W)}
with torch.inference_mode():
    outs = {w: bench.model(b, bench.kv_caches) for w, b in batches.items()}
    print("max |logit diff|", (outs[1] - outs[W]).abs().max().item(), "argmax equal", torch.equal(outs[1].argmax(-1), outs[W].argmax(-1)))
    times = {1: [], W: []}
    for _ in range(3):
        for w, b in batches.items(): bench.model(b, bench.kv_caches)
    for r in range(15):
        for w, b in (batches.items() if r % 2 else reversed(batches.items())):
            t = time.perf_counter(); bench.model(b, bench.kv_caches); times[w].append((time.perf_counter() - t) * 1e3)
for w, xs in times.items(): print(f"{dtype} {quant} ctx {ctx} width {w}: median {statistics.median(xs):.2f} ms min {min(xs):.2f}")
