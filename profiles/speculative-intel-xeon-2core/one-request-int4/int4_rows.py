"""aten._weight_int4pack_mm_for_cpu at 1-16 rows on the default model's three product shapes (2 threads): the
kernel takes rows in blocks of four, so a verify step of 1 + 4 rows pays for eight."""
import torch, time
torch.set_num_threads(2)
from asyncbatch.model.quantization import _int4_groups
for (n, k) in [(1536, 576), (576, 1536), (576*3, 576)]:
    w = torch.randn(n, k)
    codes, sz = _int4_groups(w, 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = sz.to(torch.bfloat16)
    for m in (1, 2, 3, 4, 5, 8, 16):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        for _ in range(20): torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
        t = time.perf_counter()
        for _ in range(200): torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
        dt = (time.perf_counter() - t) / 200 * 1e6
        print(f"[{n}x{k}] M={m}: {dt:.1f} us")
