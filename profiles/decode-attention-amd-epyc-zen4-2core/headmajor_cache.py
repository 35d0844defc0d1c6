"""Head-major KV memory behind the engine's logical [blocks, bs, kvh, d] cache: gather + attention costs."""
import time, torch, torch.nn.functional as F, statistics
from asyncbatch.model.paged_attention import decode_attention, plan_decode, gather_blocks, prefill_attention
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
  for B, ctx in ((1, 300), (4, 300), (8, 300), (16, 300), (32, 300), (128, 300), (32, 1000)):
    nb = (ctx + bs) // bs
    nblocks = B * nb + 8
    gen = torch.Generator().manual_seed(B)
    kc = torch.randn(nblocks, bs, kvh, d, generator=gen).to(dtype); vc = torch.randn(nblocks, bs, kvh, d, generator=gen).to(dtype)
    khm = kc.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # same values, head-major memory
    vhm = vc.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    tables = 1 + torch.randperm(B * nb, generator=gen).view(B, nb)
    lens = torch.randint(ctx // 2, ctx + 1, (B,), generator=gen)
    plan = plan_decode(tables, lens, bs, dtype)
    q = torch.randn(B, h, d, generator=gen).to(dtype)
    L = nb * bs
    mask = plan.decode_mask.view(1, B, 1, L)
    def hm_gather():
        k = khm.permute(2, 0, 1, 3).index_select(1, plan.decode_blocks).view(kvh, B, L, d)
        v = vhm.permute(2, 0, 1, 3).index_select(1, plan.decode_blocks).view(kvh, B, L, d)
        return k, v
    def hm_sdpa():
        k, v = hm_gather()
        return F.scaled_dot_product_attention(q.view(B, kvh, g, d), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=plan.decode_mask, scale=0.125).reshape(B, h, d)
    def hm_lean():
        k, v = hm_gather()
        s = torch.matmul(q.view(B, kvh, g, d).transpose(0, 1), k.transpose(-1, -2))  # [kvh, B, g, L]
        s = (s if dtype == torch.float32 else s.float()).mul_(0.125).add_(mask)
        p = torch.softmax(s, -1)
        o = torch.matmul(p if dtype == torch.float32 else p.to(dtype), v)
        return o.transpose(0, 1).reshape(B, h, d)
    cur = lambda: decode_attention(q, kc, vc, tables, lens, 0.125, plan)
    a, b, c = cur(), hm_sdpa(), hm_lean()
    n = max(5, 300 // B)
    # prefill gather of one row of ctx tokens (the prefill path's gather_blocks) on both memories
    row_blocks = tables[0]
    pg_cur = t(lambda: gather_blocks(kc, row_blocks, 1), 50)
    pg_hm = t(lambda: gather_blocks(khm, row_blocks, 1), 50)
    print(f"{str(dtype):15s} B={B:3d} ctx={ctx:4d}: current {t(cur, n):7.1f}  hm+sdpa {t(hm_sdpa, n):7.1f} (equal {torch.equal(a, b)})  "
          f"hm+lean {t(hm_lean, n):7.1f} (err {(a.float()-c.float()).abs().max().item():.0e})  | prefill gather cur {pg_cur:.1f} hm {pg_hm:.1f}")
