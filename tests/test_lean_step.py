"""The lean decode step: fused projections give the unfused model's logits, the norms and the rotation keep
transformers' arithmetic bit for bit, and a decode step dispatches a bounded number of torch ops.

The op count is the regression guard of issue 24's "as few ops per layer as the math needs" for the torch ops'
step (prefill, larger decode steps, and every step where ``ASYNCBATCH_CPU_LEAN_STEP=0`` or no C compiler; the
lean CPU step of one or two rows runs almost none: ``test_lean_cpu_step.py``): ops are
counted with a ``TorchDispatchMode`` (what reaches the kernels' dispatcher after composite ops decompose,
the same every run), per decoder layer and for the whole step, and compared with a bound that has slack
for a few ops, not for a return of the per-layer masks, separate projections or the eight-op norm (the
unfused step of the same model is counted beside it and must stay well above).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode  # private-name: the op counter's base class

from asyncbatch.model import fp16_kernel, lean_kernels, llama
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.fused_projections import is_fused
from asyncbatch.model.llama import RMSNorm
from asyncbatch.model.loader import load_model
from asyncbatch.model.packed_linears import F32_PACKED_ENV, packs_weights
from asyncbatch.model.rope import RopeTables, apply_rope, signed_sin

CPU = torch.device("cpu")
BLOCK = 4
ARCHS = {"llama": ("LlamaForCausalLM", {"tie_word_embeddings": True}), "mistral": ("MistralForCausalLM", {}),
         "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}), "qwen3": ("Qwen3ForCausalLM", {})}
# Measured per decoder layer of a one-row float32 decode step: 32 (Llama, Mistral, Qwen2), 37 (Qwen3: its q/k
# norms); before the lean step (separate projections, the eight-op norm, rotary and mask per layer) 70.
# Outside the layers (embedding, rotary rows, attention plan, final norm, LM head): 20.
MAX_OPS_PER_LAYER = 44
MAX_OPS_OUTSIDE_LAYERS = 30


@pytest.fixture(autouse=True)
def torch_ops_step(monkeypatch):
    """Every model here counts the torch ops' step: without the lean CPU step's kernels (read at load)."""
    monkeypatch.setenv(lean_kernels.LEAN_STEP_ENV, "0")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    return {name: save_tiny_model(root / name, arch, with_tokenizer=False, seed=2, **kwargs)
            for name, (arch, kwargs) in ARCHS.items()}


def _prefill_then_decode(model) -> torch.Tensor:
    """Logits of a 9-token prefill (every position) and of 3 decode rows continuing copies of it."""
    gen = torch.Generator().manual_seed(0)
    kv = model.new_kv_caches(16, BLOCK)
    ids = torch.randint(3, 250, (9,), generator=gen)
    outs = []
    with torch.inference_mode():
        for row in range(3):
            table = 1 + row * 4 + torch.arange(4)
            pos = torch.arange(9)
            batch = ForwardBatch(ids, pos, table[pos // BLOCK] * BLOCK + pos % BLOCK, 0,
                                 torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                 [PrefillRow(0, 9, 9, table[:3])], torch.arange(9))
            logits = model(batch, kv)
            if row == 0:
                outs.append(logits)
        tables = 1 + torch.arange(3)[:, None] * 4 + torch.arange(4)[None, :]
        pos = torch.full((3,), 9)
        outs.append(model(ForwardBatch(torch.randint(3, 250, (3,), generator=gen), pos,
                                       tables[:, 2] * BLOCK + 1, 3, tables, torch.full((3,), 10), [],
                                       torch.arange(3)), kv))
    return torch.cat(outs)


@pytest.mark.parametrize("name", list(ARCHS))
def test_fused_projections_give_the_unfused_logits(tiny_dirs, name, monkeypatch):
    monkeypatch.setenv(F32_PACKED_ENV, "0")  # plain float32 linears (packed ones fuse gate/up too)
    fused = load_model(tiny_dirs[name], torch.float32, CPU, max_positions=32)
    separate = load_model(tiny_dirs[name], torch.float32, CPU, max_positions=32, fuse=False)
    assert is_fused(fused) and not is_fused(separate)
    attn = fused.model.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and not hasattr(attn, "v_proj")
    assert not is_fused(fused, "gate_up_proj")  # float weights fuse q/k/v only (``fused_projections.FLOAT_GROUPS``)
    # No weight is held twice: the fused model holds as many parameters as the checkpoint.
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in separate.parameters())
    a, b = _prefill_then_decode(fused), _prefill_then_decode(separate)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, step for step."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@pytest.mark.parametrize("direct", [False, True], ids=["cast", "direct"])
@pytest.mark.parametrize("width", [576, 896, 2048, 4100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_arithmetic_bit_for_bit(dtype, width, direct):
    """Both ways of the bfloat16 norm (``direct``: the bfloat16 tensor handed to torch's norm, which a CPU model
    uses where ``rms_norm_upcasts`` holds)."""
    if direct and dtype == torch.bfloat16 and not llama.rms_norm_upcasts(dtype):
        pytest.skip("this torch build's bfloat16 norm does not compute in float32: the engine keeps the casts")
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
    norm = norm.to(dtype)
    norm.direct = direct
    for scale in (1e-3, 1.0, 300.0):
        x = (torch.randn(5, 3, width, generator=gen) * scale).to(dtype)
        with torch.inference_mode():
            assert torch.equal(norm(x), _transformers_rms_norm(x, norm.weight, 1e-5))
            assert torch.equal(norm.normalize(x) * norm.weight, _transformers_rms_norm(x, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_transformers_arithmetic_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 7, 64, generator=gen).to(dtype)  # [T, heads, head_dim]
    angles = torch.rand(6, 32, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    rotate_half = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    want = x * cos[:, None, :] + rotate_half * sin[:, None, :]
    got = apply_rope(x, RopeTables(cos[:, None, :], signed_sin(sin)[:, None, :]))
    assert torch.equal(got, want)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    @property
    def count(self) -> int:
        return len(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def count_decode_ops(model) -> tuple[list[str], list[int]]:
    """(the ops of a whole one-row decode step, how many ran inside each decoder layer)."""
    kv = model.new_kv_caches(8, BLOCK)
    table = torch.tensor([[1, 2, 3]])
    batch = ForwardBatch(torch.tensor([5]), torch.tensor([9]), torch.tensor([3 * BLOCK + 1]), 1, table,
                         torch.tensor([10]), [], torch.arange(1))
    counter = _OpCounter()
    starts, per_layer = {}, []

    def pre(module, args):
        starts[module] = counter.count

    def post(module, args, out):
        per_layer.append(counter.count - starts[module])

    hooks = [h for layer in model.model.layers
             for h in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post))]
    try:
        with torch.inference_mode():
            model(batch, kv)  # warm-up: lazy initialisations are not the step's ops
            per_layer.clear()
            with counter:
                model(batch, kv)
    finally:
        for h in hooks:
            h.remove()
    return counter.ops, per_layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_a_packed_decode_step_fuses_gate_up_and_casts_nothing(tiny_dirs, monkeypatch, dtype):
    """Weights packed for oneDNN (bfloat16 on a CPU with bfloat16 kernels; float32 on AMD, forced here): q/k/v and
    gate/up one product each, no reshape and view around a product, and (where torch's bfloat16 norm computes in
    float32, ``llama.rms_norm_upcasts``) no casts around the norms. Measured on the tiny Llama in bfloat16: 34
    ops a layer, 50 before (separate gate and up, two casts a norm, a reshape and a view a product)."""
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    monkeypatch.setenv(F32_PACKED_ENV, "1")
    monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "0")  # oneDNN's products here; the float16 kernel's: below
    if not packs_weights(dtype, CPU):
        pytest.skip(f"oneDNN's packed {dtype} product is not available in this torch build")
    model = load_model(tiny_dirs["llama"], dtype, CPU, max_positions=32)
    ops, per_layer = count_decode_ops(model)
    monkeypatch.setenv(F32_PACKED_ENV, "0")
    float_ops, _ = count_decode_ops(load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=32))
    layers = len(model.model.layers)
    assert is_fused(model, "gate_up_proj")
    assert ops.count("_linear_pointwise") == 4 * layers + 1 and "linear" not in ops  # + the LM head
    assert ops.count("reshape") <= 2 * layers + 1  # attention's own (its output), none around the products
    if dtype == torch.float32 or llama.rms_norm_upcasts(torch.bfloat16):
        assert ops.count("to") == float_ops.count("to")  # the step's own casts, none at the norms
    assert max(per_layer) <= 36, per_layer


def test_a_one_row_bfloat16_step_through_the_float16_kernel_casts_only_around_its_products(tiny_dirs, monkeypatch):
    """With fbgemm's float16 copies (``fp16_kernel``, forced on), a one-row bfloat16 step runs every product, the
    LM head's too, through the kernel and none through oneDNN, at the cost of two casts a product (its rows go in
    as float32 and come out rounded to bfloat16): the same step as oneDNN's otherwise."""
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "1")
    if not packs_weights(torch.bfloat16, CPU) or not fp16_kernel.fp16_kernel_works():
        pytest.skip("oneDNN's packed bfloat16 product or fbgemm's float16-weight kernel is missing here")
    ops, per_layer = count_decode_ops(load_model(tiny_dirs["llama"], torch.bfloat16, CPU, max_positions=32))
    monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "0")
    onednn_ops, onednn_per_layer = count_decode_ops(
        load_model(tiny_dirs["llama"], torch.bfloat16, CPU, max_positions=32))
    products = onednn_ops.count("_linear_pointwise")
    assert products == 4 * len(per_layer) + 1  # q/k/v, o, gate/up, down a layer; the LM head
    assert ops.count("linear_dynamic_fp16") == products and "_linear_pointwise" not in ops
    assert ops.count("to") == onednn_ops.count("to") + 2 * products
    assert per_layer == [n + 8 for n in onednn_per_layer]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_a_decode_step_dispatches_a_bounded_number_of_ops(tiny_dirs, name, monkeypatch):
    monkeypatch.setenv(F32_PACKED_ENV, "0")  # the plain float32 linears (the packed ones: the test above)
    model = load_model(tiny_dirs[name], torch.float32, CPU, max_positions=32)
    ops, per_layer = count_decode_ops(model)
    layers = len(model.model.layers)
    assert len(per_layer) == layers
    assert max(per_layer) <= MAX_OPS_PER_LAYER, per_layer
    assert len(ops) <= layers * MAX_OPS_PER_LAYER + MAX_OPS_OUTSIDE_LAYERS, ops
    # Per layer: five linears (q/k/v fused, o, gate, up, down) and two one-op norms; one rotation, one mask
    # for the whole step.
    assert ops.count("linear") == 5 * layers + 1  # + the LM head
    assert ops.count("rms_norm") == 2 * layers + 1 + (layers if model.model.layers[0].self_attn.qk_norm else 0)
    assert ops.count("roll") == layers and ops.count("arange") == 1 and ops.count("masked_fill_") == 1
