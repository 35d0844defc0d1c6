import torch, time, statistics
import torch.nn.functional as F
torch.set_num_threads(1)
L = 30
gs = [torch.randn(1536, 576) for _ in range(L)]; us = [torch.randn(1536, 576) for _ in range(L)]
gus = [torch.cat([g, u]) for g, u in zip(gs, us)]
def cpu(f):
    t0 = time.process_time(); f(); return (time.process_time() - t0) * 1e3
with torch.inference_mode():
  for R in (1, 8, 32):
    x = torch.randn(R, 576)
    r = {"sep": [], "fused": [], "fused-halves": []}
    for _ in range(7):
        r["sep"].append(cpu(lambda: [(F.linear(x, g), F.linear(x, u)) for g, u in zip(gs, us)]))
        r["fused"].append(cpu(lambda: [F.linear(x, w) for w in gus]))
        r["fused-halves"].append(cpu(lambda: [(F.linear(x, w[:1536]), F.linear(x, w[1536:])) for w in gus]))
    print(R, {kk: round(statistics.median(vv), 2) for kk, vv in r.items()}, "ms CPU for 30 layers")
