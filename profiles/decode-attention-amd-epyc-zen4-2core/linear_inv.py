import sys, torch
torch.set_num_threads(int(sys.argv[1]))

gen = torch.Generator().manual_seed(0)
for out_f, in_f in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
    w = torch.randn(out_f, in_f, generator=gen); x = torch.randn(32, in_f, generator=gen)
    lin = torch.nn.Linear(in_f, out_f, bias=False); lin.weight.data = w
    full = torch.nn.functional.linear(x, w)
    diffs = {B: torch.equal(torch.nn.functional.linear(x[:B], w), full[:B]) for B in (1, 2, 4, 8, 16)}
    print(f"threads {sys.argv[1]} F.linear f32 {out_f}x{in_f}: row(s) same as in 32: {diffs}")
from asyncbatch.model.packed_linears import PackedLinear
for out_f, in_f in ((960, 576), (3072, 576), (576, 1536)):
    w = torch.randn(out_f, in_f, generator=gen); x = torch.randn(32, in_f, generator=gen)
    lin = PackedLinear(w, None, None)
    with torch.inference_mode():
        full = lin(x)
        diffs = {B: torch.equal(lin(x[:B]), full[:B]) for B in (1, 2, 4, 8, 16)}
    print(f"threads {sys.argv[1]} PackedLinear f32 {out_f}x{in_f}: row(s) same as in 32: {diffs}")
