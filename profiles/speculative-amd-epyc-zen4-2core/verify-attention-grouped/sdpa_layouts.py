"""The CPU decode attention of one verify row (W positions, context 320, SmolLM2-135M shapes: 9 heads, 3 KV heads,
head dim 64) two ways: each position a batch entry with its own gather (the engine's layout), and the row's context
gathered once with its W positions as queries of one entry (the tried layout). Min and median of six blocks.

    python sdpa_layouts.py bfloat16 4
"""
import torch, time
import torch.nn.functional as F
torch.set_num_threads(2)
import sys
dt = getattr(torch, sys.argv[1])
nb, bs, kvh, d, h = 4000, 16, 3, 64, 9
kc = torch.randn(nb, bs, kvh, d, dtype=dt); vc = torch.randn(nb, bs, kvh, d, dtype=dt)
W, L = int(sys.argv[2]), 320
blocks = torch.arange(100, 100 + L // bs)
ctx = torch.tensor([L - W + 1 + i for i in range(W)])
def cur():
    q = torch.randn(W, h, d, dtype=dt)
    b = blocks.repeat(W)
    k = kc.index_select(0, b).view(W, -1, kvh, d).transpose(1, 2)
    v = vc.index_select(0, b).view(W, -1, kvh, d).transpose(1, 2)
    pos = torch.arange(L)
    mask = torch.zeros(W, L, dtype=dt).masked_fill_(pos[None] >= ctx[:, None], float("-inf"))[:, None, None, :]
    return q, k, v, mask
def new():
    q = torch.randn(W, h, d, dtype=dt)
    k = kc.index_select(0, blocks).view(1, -1, kvh, d).transpose(1, 2)
    v = vc.index_select(0, blocks).view(1, -1, kvh, d).transpose(1, 2)
    pos = torch.arange(L)
    mask = torch.zeros(W, L, dtype=dt).masked_fill_(pos[None] >= ctx[:, None], float("-inf")).repeat_interleave(3, 0)[None, None]
    return q, k, v, mask
qc, kcur, vcur, mcur = cur()
qn, kn, vn, mn = new()
def run_cur():
    k = kc.index_select(0, blocks.repeat(W)).view(W, -1, kvh, d).transpose(1, 2)
    v = vc.index_select(0, blocks.repeat(W)).view(W, -1, kvh, d).transpose(1, 2)
    return F.scaled_dot_product_attention(qc.view(W, kvh, 3, d), k, v, attn_mask=mcur, scale=0.125).reshape(W, h, d)
def run_new():
    k = kc.index_select(0, blocks).view(1, -1, kvh, d).transpose(1, 2)
    v = vc.index_select(0, blocks).view(1, -1, kvh, d).transpose(1, 2)
    qg = qc.view(1, W, kvh, 3, d).permute(0, 2, 1, 3, 4).reshape(1, kvh, W * 3, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mn, scale=0.125)
    return out.view(1, kvh, W, 3, d).permute(0, 2, 1, 3, 4).reshape(W, h, d)
a, b = run_cur(), run_new()
print("max diff", (a.float() - b.float()).abs().max().item(), "equal", torch.equal(a, b))
res = {run_cur.__name__: [], run_new.__name__: []}
for _ in range(6):
    for f in (run_cur, run_new):
        for _ in range(30): f()
        t = time.perf_counter()
        for _ in range(300): f()
        res[f.__name__].append((time.perf_counter() - t) / 300 * 1e6)
print({k: round(min(v), 1) for k, v in res.items()}, {k: round(sorted(v)[3], 1) for k, v in res.items()})
