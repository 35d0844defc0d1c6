import time, torch, torch.nn.functional as F, statistics
torch.set_num_threads(2)
def t(f, n):
    for _ in range(3): f()
    xs = []
    for _ in range(7):
        s = time.perf_counter()
        for _ in range(n): f()
        xs.append((time.perf_counter() - s) / n * 1e6)
    return statistics.median(xs)
h, kvh, d = 9, 3, 64
g = h // kvh
def lean(q, k, v, add, dtype):
    # scores [B, kvh, g, L] = scale * q k^T + mask, softmax in float32 for bf16
    s = torch.matmul(q, k.transpose(-1, -2))
    if dtype == torch.float32:
        s.mul_(0.125).add_(add)
        return torch.matmul(torch.softmax(s, -1), v)
    s = s.float().mul_(0.125).add_(add)
    return torch.matmul(torch.softmax(s, -1).to(dtype), v)
for dtype in (torch.float32, torch.bfloat16):
  gen = torch.Generator().manual_seed(0)
  for B, ctx in ((1, 300), (4, 300), (16, 300), (32, 300), (128, 300)):
    L = ((ctx + 15) // 16) * 16
    q = torch.randn(B, kvh, g, d, generator=gen).to(dtype)
    k = torch.randn(B, kvh, L, d, generator=gen).to(dtype); v = torch.randn(B, kvh, L, d, generator=gen).to(dtype)
    lens = torch.randint(ctx // 2, ctx + 1, (B,), generator=gen)
    beyond = torch.arange(L)[None, :] >= lens[:, None]
    add = torch.zeros(beyond.shape, dtype=dtype).masked_fill_(beyond, float("-inf"))[:, None, None, :]
    addf = add.float()
    m = addf if dtype != torch.float32 else add
    sd = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=0.125)
    ln = lambda: lean(q, k, v, m, dtype)
    full = ln()
    # batch invariance: row 0 alone vs in the batch; same for SDPA
    alone = lean(q[:1], k[:1], v[:1], m[:1], dtype)
    sd_alone = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=add[:1], scale=0.125)
    n = max(5, 400 // B)
    print(f"{str(dtype):15s} B={B:3d}: sdpa {t(sd, n):7.1f} us  lean {t(ln, n):7.1f} us  "
          f"row0 alone==in batch: lean {torch.equal(alone[0], full[0])} sdpa {torch.equal(sd_alone[0], sd()[0])}")
