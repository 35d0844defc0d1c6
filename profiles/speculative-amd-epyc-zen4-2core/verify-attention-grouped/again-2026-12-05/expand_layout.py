import time, torch, torch.nn.functional as F, statistics
from asyncbatch.model.paged_attention import decode_attention, plan_decode, gather_blocks
torch.set_num_threads(2)
for dtype in (torch.float32, torch.bfloat16):
  for D, ctx in ((1, 400), (1, 1500), (4, 400)):
    W, h, kvh, d, bs, nblocks = 4, 9, 3, 64, 16, 4096
    g = h // kvh
    kc = torch.randn(nblocks, bs, kvh, d, dtype=dtype); vc = torch.randn_like(kc)
    maxb = (ctx + W + bs - 1) // bs
    tables = torch.stack([torch.randperm(nblocks)[:maxb] for _ in range(D)])  # [D, B]
    ctxs = torch.tensor([ctx + w + 1 for _ in range(D) for w in range(W)])
    q = torch.randn(D * W, h, d, dtype=dtype)
    rep = tables.repeat_interleave(W, 0)
    plan = plan_decode(rep, ctxs, bs, dtype)
    fo = lambda: decode_attention(q, kc, vc, rep, ctxs, 0.125, plan)
    L = maxb * bs
    mask5 = plan.decode_mask.view(D, W, 1, 1, L)
    flat = tables.reshape(-1)
    def fn():
        k = gather_blocks(kc, flat, D).transpose(1, 2).unsqueeze(1).expand(D, W, kvh, L, d)
        v = gather_blocks(vc, flat, D).transpose(1, 2).unsqueeze(1).expand(D, W, kvh, L, d)
        qg = q.view(D, W, kvh, g, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask5, scale=0.125)
        return out.reshape(D * W, h, d)
    a, b = fo(), fn()
    # plain decode of position 0 alone
    p0 = plan_decode(tables, ctxs.view(D, W)[:, 0].contiguous(), bs, dtype)
    c = decode_attention(q.view(D, W, h, d)[:, 0].contiguous(), kc, vc, tables, ctxs.view(D, W)[:, 0], 0.125, p0)
    def t(f):
        for _ in range(20): f()
        xs = []
        for _ in range(7):
            s = time.perf_counter()
            for _ in range(100): f()
            xs.append((time.perf_counter() - s) / 100 * 1e6)
        return statistics.median(xs)
    print(f"{dtype} D={D} ctx={ctx}: per-position {t(fo):.1f} us, expanded {t(fn):.1f} us  equal {torch.equal(a, b)} "
          f"pos0==plain old {torch.equal(a.view(D,W,h,d)[:,0], c)} new {torch.equal(b.view(D,W,h,d)[:,0], c)}")
