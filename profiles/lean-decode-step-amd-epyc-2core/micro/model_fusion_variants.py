import time, torch, statistics
from torch import nn
from harness.decode_step import decode_batch, BLOCK_SIZE
from asyncbatch.model.loader import load_model, resolve_model_path
from asyncbatch.model.fused_projections import fused_linear
torch.set_num_threads(1)
path = resolve_model_path(None)
ms = {n: load_model(path, torch.float32, torch.device("cpu"), 128, fuse=(n != "separate")) for n in ("fused", "qkv-only", "separate")}
for layer in ms["qkv-only"].model.layers:
    w = layer.mlp.gate_up_proj.weight; i = w.shape[0] // 2
    layer.mlp.gate_proj = fused_linear(w[:i].clone(), None); layer.mlp.up_proj = fused_linear(w[i:].clone(), None)
    layer.mlp.gate_up_proj = None
kv = {n: m.new_kv_caches(1 + 32 * 8, BLOCK_SIZE) for n, m in ms.items()}
rows = (1, 8, 32)
res = {n: {r: [] for r in rows} for n in ms}
with torch.inference_mode():
    for _ in range(5):
        for r in rows:
            b = decode_batch(r, 128, vocab=49152)
            n_it = {1: 10, 8: 5, 32: 3}[r]
            for n, m in ms.items():
                m(b, kv[n])
                t0 = time.process_time()
                for _ in range(n_it): m(b, kv[n])
                res[n][r].append((time.process_time() - t0) / n_it * 1e3)
for n in res:
    print(n, {r: round(statistics.median(v), 1) for r, v in res[n].items()})
