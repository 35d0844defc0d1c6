import torch
import torch.nn.functional as F
for dt in (torch.float32, torch.bfloat16):
  for B in (1, 5, 32):
    q = torch.randn(B, 3, 3, 64).to(dt); k = torch.randn(B, 3, 128, 64).to(dt); v = torch.randn(B, 3, 128, 64).to(dt)
    lens = torch.randint(1, 129, (B,))
    mask = (torch.arange(128)[None] < lens[:, None])[:, None, None, :]
    fmask = torch.zeros(mask.shape, dtype=dt).masked_fill_(~mask, float("-inf"))
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    b = F.scaled_dot_product_attention(q, k, v, attn_mask=fmask, scale=0.125)
    print(dt, B, torch.equal(a, b))
q = torch.randn(2, 3, 3, 64); k = torch.randn(2, 3, 128, 64); v = torch.randn(2, 3, 128, 64)
mask = torch.zeros(2,1,1,128, dtype=torch.bool); mask[0] = True
fmask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask); b = F.scaled_dot_product_attention(q, k, v, attn_mask=fmask)
print(a[1,0,0,:3], b[1,0,0,:3], torch.equal(a[0], b[0]))
