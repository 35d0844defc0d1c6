"""The int4 linears of the default model's decoder (30 layers of q/k/v, o, gate/up, down, random weights in the
engine's ``QuantizedLinear``) at 1-8 rows of bfloat16 activations, two torch threads, medians of 15 passes: what a
verify step's 1 + k rows cost against a one-row step in the kernel (``aten._weight_int4pack_mm_for_cpu``).

    PYTHONPATH=<tree> python int4_rows.py
"""
import statistics
import time

import torch

from asyncbatch.model.quantization import QuantizedLinear

torch.set_num_threads(2)
SHAPES = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # (out, in): qkv, o, gate/up, down
layers = [[QuantizedLinear(torch.randn(n, k) * 0.02, None, "int4") for n, k in SHAPES] for _ in range(30)]
with torch.inference_mode():
    for rows in (1, 2, 3, 4, 5, 8):
        x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
        times = []
        for _ in range(15):
            t = time.perf_counter()
            for layer in layers:
                for linear in layer:
                    linear(x[linear.in_features])
            times.append(time.perf_counter() - t)
        print(f"{rows} rows: {statistics.median(times) * 1e3:.2f} ms for the 120 linears")
