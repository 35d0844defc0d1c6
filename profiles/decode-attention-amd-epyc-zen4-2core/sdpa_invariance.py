"""Is a decode row's attention output the same alone and inside a batch? (torch SDPA on the CPU)"""
import sys, torch, torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
h, kvh, d, g = 9, 3, 64, 3
for dtype in (torch.float32, torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    for B in (2, 4, 8, 32):
        for L in (64, 304, 1008):
            q = torch.randn(B, kvh, g, d, generator=gen).to(dtype)
            k = torch.randn(B, kvh, L, d, generator=gen).to(dtype); v = torch.randn(B, kvh, L, d, generator=gen).to(dtype)
            lens = torch.randint(L // 2, L + 1, (B,), generator=gen)
            mask = torch.zeros(B, L, dtype=dtype).masked_fill_(torch.arange(L)[None] >= lens[:, None], float("-inf"))[:, None, None]
            full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
            diffs = [(F.scaled_dot_product_attention(q[i:i+1], k[i:i+1], v[i:i+1], attn_mask=mask[i:i+1], scale=0.125)[0] - full[i]).abs().max().item() for i in range(B)]
            print(f"threads {sys.argv[1]} {str(dtype):15s} B={B:2d} L={L:4d}: rows differing {sum(x > 0 for x in diffs)}/{B}, max |diff| {max(diffs):.1e}")
