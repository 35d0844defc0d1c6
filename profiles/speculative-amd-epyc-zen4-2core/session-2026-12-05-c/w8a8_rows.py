"""fbgemm's dynamic int8 product (what w8a8 runs) per weight shape of SmolLM2-135M at 2-9 rows (one row is
two with w8a8's sentinel row), 2 threads, us a call; beside it torch's int4 kernel's blocks of four rows
(``../session-2026-12-05/int4_rows.py``)."""
import time
import warnings

import torch

torch.set_num_threads(2)
warnings.simplefilter("ignore")


def t(f, n=300):
    for _ in range(30):
        f()
    s = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - s) / n * 1e6


for k, n in [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]:
    w = torch.randn(n, k)
    scales = w.abs().amax(1) / 127
    q = torch.quantize_per_channel(w, scales.double(), torch.zeros(n, dtype=torch.int64), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    cells = []
    for m in (2, 4, 5, 6, 7, 9):
        x = torch.randn(m, k).clamp(-1, 1)
        cells.append(f"{m} rows {t(lambda: torch.ops.quantized.linear_dynamic(x, packed, True)):5.0f}")
    print(f"{k:5d} x {n:5d}: " + "  ".join(cells))
