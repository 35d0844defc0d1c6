"""The one-row step's 120 decoder products (SmolLM2-135M's shapes, bfloat16, oneDNN's packed weights, 2 threads),
back to back: 30 distinct layers' weights or the same four hot, in the layer's order (q/k/v, o, gate/up, down)
or grouped by shape: what the weights' bandwidth costs and what switching between product shapes costs.

    python profiles/lean-decode-step-intel-xeon-2core/product-order/product_order.py
"""
import torch, time, statistics
torch.set_num_threads(2)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
def mk(n): return [[torch.ops.mkldnn._reorder_linear_weight(torch.randn(a, b).to(torch.bfloat16), None) for a, b in shapes] for _ in range(n)]
X = {576: torch.randn(1, 576).to(torch.bfloat16), 1536: torch.randn(1, 1536).to(torch.bfloat16)}
def seq(layers, order):
    def f():
        for L in layers:
            for j in order:
                torch.ops.mkldnn._linear_pointwise(X[shapes[j][1]], L[j], None, "none", [], "")
    return f
def bench(f, reps=15):
    f(); f(); ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1e3
few = mk(1) * 30     # same 4 weights 30 times: hot weights, alternating shapes
many = mk(30)        # 30 distinct layers
print("hot weights, alternating shapes  %.2f ms" % bench(seq(few, [0,1,2,3])))
print("distinct weights, alternating     %.2f ms" % bench(seq(many, [0,1,2,3])))
# grouped by shape: all qkv first, then all o, ...
def grouped(layers):
    def f():
        for j in range(4):
            for L in layers:
                torch.ops.mkldnn._linear_pointwise(X[shapes[j][1]], L[j], None, "none", [], "")
    return f
print("distinct weights, grouped by shape %.2f ms" % bench(grouped(many)))
print("hot weights grouped                %.2f ms" % bench(grouped(few)))
