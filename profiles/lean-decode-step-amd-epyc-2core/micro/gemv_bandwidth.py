import torch, time
import torch.nn.functional as F
torch.set_num_threads(1)
# 30 layers worth of weights so the set exceeds caches: like one step's linears
ws = [torch.randn(960, 576) for _ in range(30)] + [torch.randn(3072, 576) for _ in range(30)] + [torch.randn(576, 1536) for _ in range(30)] + [torch.randn(576, 576) for _ in range(30)] + [torch.randn(49152, 576)]
nbytes = sum(w.nbytes for w in ws)
xs = {k: torch.randn(1, k) for k in (576, 1536)}
def lin():
    for w in ws: F.linear(xs[w.shape[1]], w)
def mv():
    for w in ws: torch.mv(w, xs[w.shape[1]][0])
def mm_n():
    for w in ws: torch.matmul(w, xs[w.shape[1]].T)
res = {n: [] for n in ("linear", "mv", "w@x")}
with torch.inference_mode():
    for _ in range(6):
        for n, f in (("linear", lin), ("mv", mv), ("w@x", mm_n)):
            t0 = time.perf_counter(); f(); res[n].append(time.perf_counter() - t0)
for n, v in res.items():
    v.sort(); print(n, f"median {v[len(v)//2]*1e3:.1f} ms min {v[0]*1e3:.1f} ms -> {nbytes/v[0]/1e9:.1f} GB/s best")
a = torch.ones(nbytes // 4); ts = []
for _ in range(5):
    t0 = time.perf_counter(); a.sum(); ts.append(time.perf_counter() - t0)
print("sum", f"{nbytes/min(ts)/1e9:.1f} GB/s best")
