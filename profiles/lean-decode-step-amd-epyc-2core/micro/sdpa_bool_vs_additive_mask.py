import torch, time
import torch.nn.functional as F
torch.set_num_threads(1)
def cpu(f, n):
    t0 = time.process_time()
    for _ in range(n): f()
    return (time.process_time() - t0) / n * 1e6
with torch.inference_mode():
    for B in (1, 8, 32):
        q = torch.randn(B, 3, 3, 64); k = torch.randn(B, 3, 128, 64).transpose(1,2).contiguous().transpose(1,2); v = k.clone()
        lens = torch.full((B,), 128)
        mask = (torch.arange(128)[None] < lens[:, None])[:, None, None, :]
        fmask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
        n = 400 if B == 1 else 60
        r = {"bool": [], "float": []}
        for _ in range(5):
            r["bool"].append(cpu(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125), n))
            r["float"].append(cpu(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fmask, scale=0.125), n))
        print(B, {kk: round(sorted(vv)[2], 1) for kk, vv in r.items()}, "us CPU median")
