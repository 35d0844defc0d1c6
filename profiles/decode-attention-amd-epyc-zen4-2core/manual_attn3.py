import time, torch, torch.nn.functional as F, statistics
from asyncbatch.model.paged_attention import gather_blocks, plan_decode
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
for dtype in (torch.float32, torch.bfloat16):
  for B, ctx in ((1, 300), (8, 300), (32, 300), (128, 300), (32, 1000)):
    nb = (ctx + bs) // bs
    kc = torch.randn(B * nb + 8, bs, kvh, d).to(dtype); vc = torch.randn_like(kc)
    tables = 1 + torch.arange(B * nb).view(B, nb)
    lens = torch.randint(ctx // 2, ctx + 1, (B,))
    plan = plan_decode(tables, lens, bs, dtype)
    q = torch.randn(B, h, d).to(dtype)
    def common():
        k = gather_blocks(kc, plan.decode_blocks, B).transpose(1, 2)
        v = gather_blocks(vc, plan.decode_blocks, B).transpose(1, 2)
        return k, v, q.view(B, kvh, g, d)
    def sd():
        k, v, qg = common()
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.decode_mask, scale=0.125)
    def lean():
        k, v, qg = common()
        s = torch.matmul(qg, k.transpose(-1, -2))
        if dtype != torch.float32:
            s = s.float()
        s.mul_(0.125).add_(plan.decode_mask)
        p = torch.softmax(s, -1)
        return torch.matmul(p if dtype == torch.float32 else p.to(dtype), v)
    def lean_f32scores():  # bf16 inputs, f32 scores via upcast k
        k, v, qg = common()
        s = torch.matmul(qg.float(), k.float().transpose(-1, -2)).mul_(0.125).add_(plan.decode_mask)
        return torch.matmul(torch.softmax(s, -1).to(dtype), v)
    n = max(5, 300 // B)
    ref = sd().float()
    extra = "" if dtype == torch.float32 else f"  lean-f32-scores {t(lean_f32scores, n):7.1f} (err {(lean_f32scores().float()-ref).abs().max().item():.1e})"
    print(f"{str(dtype):15s} B={B:3d} ctx={ctx}: sdpa {t(sd, n):7.1f}  lean {t(lean, n):7.1f} (err {(lean().float()-ref).abs().max().item():.1e}){extra}")
