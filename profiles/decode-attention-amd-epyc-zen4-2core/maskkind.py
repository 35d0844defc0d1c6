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
for dtype in (torch.bfloat16, torch.float32):
  for B, ctx in ((1, 300), (8, 300), (32, 300), (32, 1000), (128, 300)):
    L = ((ctx + 15) // 16) * 16
    q = torch.randn(B, kvh, h // kvh, d, dtype=dtype)
    k = torch.randn(B, kvh, L, d, dtype=dtype); v = torch.randn_like(k)
    lens = torch.randint(ctx // 2, ctx + 1, (B,))
    beyond = torch.arange(L)[None, :] >= lens[:, None]
    add = torch.zeros(beyond.shape, dtype=dtype).masked_fill_(beyond, float("-inf"))[:, None, None, :]
    boolean = (~beyond)[:, None, None, :]
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=0.125)
    b = F.scaled_dot_product_attention(q, k, v, attn_mask=boolean, scale=0.125)
    n = max(5, 400 // B)
    ta = t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=0.125), n)
    tb = t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=boolean, scale=0.125), n)
    print(f"{str(dtype):15s} B={B:3d} ctx={ctx:4d}: additive {ta:8.1f} us  boolean {tb:8.1f} us  ratio {tb/ta:.2f}  equal {torch.equal(a, b)}")
