"""SmolLM2-135M's 150 decoder products and its LM head (random bfloat16 weights of its shapes, 257 MiB, each read
once a pass: cold, as in a real decode step) at 1-4 rows and 2 torch threads, through oneDNN's packed bfloat16
product (the engine's path before), fbgemm's float16-weight kernel as the engine calls it (``fp16_kernel``), and
``F.linear`` on the plain weight; a ``sum()`` over as many bytes for the read rate. Five interleaved rounds, the
median of five passes each; GB/s = weight bytes / time.

    python profiles/fp16-weight-kernel-amd-epyc-zen4-2core/products.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from asyncbatch.model.fp16_kernel import fp16_product, pack_fp16  # noqa: E402

torch.set_num_threads(2)
SHAPES = [(960, 576)] * 30 + [(1536, 576)] * 60 + [(576, 1536)] * 30 + [(576, 576)] * 30 + [(49152, 576)]
gen = torch.Generator().manual_seed(0)
weights = [(torch.randn(*s, generator=gen) * 0.02).bfloat16() for s in SHAPES]
nbytes = sum(w.numel() * 2 for w in weights)
onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
fp16 = [pack_fp16(w, None) for w in weights]
ones = torch.ones(nbytes // 4)
print(f"{nbytes / 2**20:.0f} MiB of bfloat16 weights a pass; 2 torch threads; 5 rounds, median of 5 passes each")
for rows in (1, 2, 3, 4):
    xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}
    paths = {
        "sum() over as many bytes": lambda: ones.sum(),
        "oneDNN packed bfloat16": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                           for w, p in zip(weights, onednn)],
        "fbgemm float16 weights": lambda: [fp16_product(xs[w.shape[1]], p) for w, p in zip(weights, fp16)],
        "F.linear, plain weight": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
    }
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(5):
        for name, run in paths.items():
            run()
            passes = []
            for _ in range(5):
                t0 = time.perf_counter()
                run()
                passes.append(time.perf_counter() - t0)
            times[name].append(statistics.median(passes))
    base = statistics.median(times["oneDNN packed bfloat16"])
    for name, values in times.items():
        m = statistics.median(values)
        print(f"rows {rows}  {name:26s} {m * 1e3:6.2f} ms  {nbytes / m / 1e9:5.1f} GB/s  {m / base:5.2f}x oneDNN  "
              f"(rounds: {' '.join(f'{v * 1e3:.1f}' for v in values)})")
