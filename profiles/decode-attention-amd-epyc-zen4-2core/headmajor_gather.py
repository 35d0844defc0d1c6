import time, torch, torch.nn.functional as F, statistics, sys
from asyncbatch.model.paged_attention import decode_attention, plan_decode
torch.set_num_threads(2)
def t(f, n):
    for _ in range(3): f()
    xs = []
    for _ in range(7):
        s = time.perf_counter()
        for _ in range(n): f()
        xs.append((time.perf_counter() - s) / n * 1e6)
    return statistics.median(xs)
h, kvh, d, bs = 9, 3, 64, 16
g = h // kvh
for dtype in (torch.bfloat16, torch.float32):
  for B, ctx in ((1, 300), (4, 300), (8, 300), (32, 300), (128, 300), (32, 1000)):
    nb = (ctx + bs) // bs
    gen = torch.Generator().manual_seed(B)
    kc = torch.randn(B * nb + 8, bs, kvh, d, generator=gen).to(dtype); vc = torch.randn(B * nb + 8, bs, kvh, d, generator=gen).to(dtype)
    tables = 1 + torch.randperm(B * nb, generator=gen).view(B, nb)
    lens = torch.randint(ctx // 2, ctx + 1, (B,), generator=gen)
    plan = plan_decode(tables, lens, bs, dtype)
    q = torch.randn(B, h, d, generator=gen).to(dtype)
    L = nb * bs
    mask = plan.decode_mask.view(1, B, 1, L)
    def head_major():
        k = kc.permute(2, 0, 1, 3).index_select(1, plan.decode_blocks).view(kvh, B, L, d)
        v = vc.permute(2, 0, 1, 3).index_select(1, plan.decode_blocks).view(kvh, B, L, d)
        qh = q.view(B, kvh, g, d).transpose(0, 1)  # [kvh, B, g, d] view
        s = torch.matmul(qh, k.transpose(-1, -2))  # [kvh, B, g, L]
        if dtype != torch.float32:
            s = s.float()
        s.mul_(0.125).add_(mask)
        p = torch.softmax(s, -1)
        o = torch.matmul(p if dtype == torch.float32 else p.to(dtype), v)  # [kvh, B, g, d]
        return o.transpose(0, 1).reshape(B, h, d)
    cur = lambda: decode_attention(q, kc, vc, tables, lens, 0.125, plan)
    a, b = cur(), head_major()
    n = max(5, 300 // B)
    print(f"{str(dtype):15s} B={B:3d} ctx={ctx:4d}: current {t(cur, n):8.1f} us  head-major matmul {t(head_major, n):8.1f} us  max|diff| {(a.float()-b.float()).abs().max().item():.1e}")
