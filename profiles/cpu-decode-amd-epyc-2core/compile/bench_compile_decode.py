"""Eager vs compiled decode step (``CompiledDecode``), one process: python bench_compile_decode.py PRECISION THREADS ROWS."""
import sys, time, json, statistics, torch
from harness.decode_step import DecodeStepBench, decode_batch, greedy_sampling
from asyncbatch.model.compiled_decode import CompiledDecode
from asyncbatch.sampling.sampler import sample
prec = sys.argv[1]; threads = int(sys.argv[2]); rows = [int(r) for r in sys.argv[3].split(",")]
b = DecodeStepBench(quantization=None if prec == "float32" else prec, threads=threads, max_rows=max(rows))
eager = {r: b.time_steps(r, repeats=7, warmup=2) for r in rows}
cd = CompiledDecode(b.model, b.kv_caches)
t0, c0 = time.perf_counter(), time.process_time(); cd.warm_up(); comp_s = time.perf_counter() - t0; comp_cpu = time.process_time() - c0
def step(r):
    batch = decode_batch(r, b.context, vocab=b.vocab)
    with torch.inference_mode():
        return sample(cd(batch), greedy_sampling(r), all_greedy=True).token_ids
for r in rows:
    for _ in range(2): step(r)
    s, cpu = [], []
    for _ in range(7):
        t1, c1 = time.perf_counter(), time.process_time(); step(r); s.append((time.perf_counter() - t1) * 1e3); cpu.append((time.process_time() - c1) * 1e3)
    e = eager[r]
    print(json.dumps(dict(prec=prec, threads=threads, rows=r, eager_med=round(e.median_ms, 1), eager_min=round(e.min_ms, 1), eager_cpu=round(e.cpu_median_ms, 1),
          comp_med=round(statistics.median(s), 1), comp_min=round(min(s), 1), comp_cpu=round(statistics.median(cpu), 1), compile_s=round(comp_s, 1), compile_cpu_s=round(comp_cpu, 1))), flush=True)
import os; print("loadavg", os.getloadavg(), flush=True)
