"""The lean CPU decode step: every decoder layer as its four matrix products and five calls of ``lean_cpu.c``.

**Why.** A one-row decode step reads every weight once, so it should take about as long as reading them. In
eager torch it did not: SmolLM2-135M's one-row step ran ~1,300 torch ops, 42 a layer (the norms' casts and
weight products, rotary's products, roll and sum, the cache writes, the gathers and views around the
attention, the SiLU and its product, the residual adds, the casts around fbgemm's float16-weight products),
and on a 2-vCPU Zen 4 VM the ones between the products took ~7.7 of a bfloat16 step's ~19 ms, against a
memory floor of ~7.8 ms (``profiles/lean-cpu-step-amd-epyc-zen4-2core``). Here a layer is:

    h = rms_norm(x) * w                    ab_rms_norm (first layer) / ab_add_rms_norm (the residual sum too)
    qkv = qkv_proj(h)                      the product (fbgemm's float16 copy, oneDNN's packed one, MKL, int8)
    q = rope(q); cache[slot] = rope(k), v  ab_qkv_rope_write
    a = attention(q, cache)                ab_decode_attention (reads the paged cache through the block table)
    o = o_proj(a)
    x += o; h = rms_norm(x) * w            ab_add_rms_norm
    gate, up = gate_up_proj(h)
    m = silu(gate) * up                    ab_silu_mul
    d = down_proj(m)
    x += d (and the next layer's norm)     ab_add_rms_norm

**Numerics.** Each kernel rounds where the torch ops it replaces round (``lean_cpu.c``): in float32 nothing
is rounded and the results are the torch path's up to the order of float32 sums (the norm's variance, the
attention's dot products and softmax, which also differs from ``scaled_dot_product_attention``'s blocked
one); in bfloat16 they differ from it only where such a sum's last bit moves a value across a bfloat16 rounding
boundary, and the attention's weighted sum of values is taken in float32 where the fused SDPA kernel rounds its
probabilities to bfloat16 first. Products keep their own paths: their inputs come as float32 holding the
model's values (exact in float32; fbgemm's kernel takes float32 and no cast is needed) and their outputs are
rounded by the kernel that reads them, as ``.to(dtype)`` would.

**Where.** CPU models whose step is decode rows only (no prefill chunk, no verify rows: one token a row), at
most ``LEAN_MAX_ROWS`` rows and ``LEAN_MAX_CONTEXT`` context tokens in all (the kernels run on one thread;
larger steps keep torch's, whose attention runs on every thread), in float32 or bfloat16, without Qwen3's q/k
norms, with q/k/v fused (``fused_projections``), outside ``torch.compile`` (``compile_decode`` keeps the traced
torch ops), where ``lean_kernels.library()`` built; ``ASYNCBATCH_CPU_LEAN_STEP=0`` keeps the torch ops
everywhere (to compare).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from asyncbatch.model import lean_kernels
from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.fp16_kernel import FP16_KERNEL_MAX_ROWS, fp16_product_float32
from asyncbatch.model.packed_linears import PackedLinear
from asyncbatch.model.rope import RopeTables

# Measured on a 2-vCPU Zen 4 with the kernels' first attention (profiles/lean-cpu-step-amd-epyc-zen4-2core):
# bfloat16 steps of 1-2 rows 0.76-0.92x the torch ops' time at contexts up to 1,024 a row, 4 rows 0.96x at 128
# but 1.15x at 512 (the attention here runs on one thread, torch's on both), 6-8 rows slower; so at most 2 rows
# and 2,048 context tokens in all.
LEAN_MAX_ROWS = 2
LEAN_MAX_CONTEXT = 2048
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def lean_library(model: nn.Module, device: torch.device):
    """The kernels for ``model`` (a loaded ``CausalLM``) on ``device``, or None where the lean step does not
    apply to it at all (the module docstring's model conditions)."""
    dtype = model.model.embed_tokens.weight.dtype
    layer = model.model.layers[0]
    if (device.type != "cpu" or dtype not in DTYPE_CODES or layer.self_attn.qk_norm
            or layer.self_attn.qkv_proj is None or not lean_kernels.wanted()):
        return None
    return lean_kernels.library()


def applies(batch: ForwardBatch) -> bool:
    """Whether this step's batch is one the lean step serves (the model already has its kernels)."""
    if torch.compiler.is_compiling():  # first: a traced shape test would specialise the graph's dynamic sizes
        return False
    rows = batch.num_decode
    return (0 < rows <= LEAN_MAX_ROWS and not batch.prefill_rows and batch.input_ids.shape[0] == rows
            and int(batch.decode_context_lens.sum()) <= LEAN_MAX_CONTEXT)


def _code(t: torch.Tensor) -> int:
    return DTYPE_CODES[t.dtype]


@dataclass(slots=True)
class LeanNorm:
    """An RMSNorm's weight as the kernels take it."""

    weight: int  # data pointer
    code: int  # its dtype's code
    eps: float


@dataclass(slots=True)
class LeanLayer:
    """What the lean step reads of one decoder layer, gathered once per model (``layer_plan``)."""

    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor] | None  # fused gate | up, or None: ``gate`` and ``up``
    gate: Callable[[torch.Tensor], torch.Tensor] | None
    up: Callable[[torch.Tensor], torch.Tensor] | None
    down: Callable[[torch.Tensor], torch.Tensor]
    scale: float
    input_norm: LeanNorm
    post_norm: LeanNorm


def _product(linear: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """``linear`` as a function of a step's ``h`` (float32 holding ``dtype`` values where the step is wide, else
    ``dtype``): fbgemm's float16 copy takes float32 as it is and returns it unrounded (the next kernel rounds);
    every other path gets ``dtype`` and returns a dense tensor."""
    fp16 = getattr(linear, "fp16", None) if isinstance(linear, PackedLinear) else None
    if fp16 is not None and LEAN_MAX_ROWS <= FP16_KERNEL_MAX_ROWS:
        # ``h`` is bfloat16 where the q/k/v product has no float16 copy (a weight float16 cannot hold).
        return lambda h: fp16_product_float32(h, fp16)

    def product(h: torch.Tensor) -> torch.Tensor:
        out = linear(h if h.dtype == dtype else h.to(dtype))
        return out if out.is_contiguous() else out.contiguous()
    return product


def _norm(norm: nn.Module) -> LeanNorm:
    return LeanNorm(norm.weight.data_ptr(), _code(norm.weight), norm.eps)


def layer_plan(model: nn.Module, dtype: torch.dtype) -> list[LeanLayer]:
    """The model's layers as ``LeanLayer``s, built at its first lean step and kept on it as ``lean_plan`` (its
    weights do not move; a profiler may wrap the products it holds)."""
    plan = model.lean_plan
    if plan is None:
        plan = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = mlp.gate_up_proj is not None
            plan.append(LeanLayer(_product(attn.qkv_proj, dtype), _product(attn.o_proj, dtype),
                                  _product(mlp.gate_up_proj, dtype) if fused else None,
                                  None if fused else _product(mlp.gate_proj, dtype),
                                  None if fused else _product(mlp.up_proj, dtype), _product(mlp.down_proj, dtype),
                                  attn.scale, _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)))
        model.lean_plan = plan
    return plan


def lean_layers(model: nn.Module, lib, x: torch.Tensor, batch: ForwardBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rope: RopeTables) -> torch.Tensor:
    """Every decoder layer of ``model`` over the embedded tokens ``x`` (``[T, hidden]``, the model's dtype,
    updated in place as the residual stream); returns it."""
    layers = model.model.layers
    attn0, mlp0 = layers[0].self_attn, layers[0].mlp
    dtype, bf = x.dtype, int(x.dtype == torch.bfloat16)
    plan = layer_plan(model, dtype)
    t, hidden = x.shape
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    # The products' inputs in float32 (exact for bfloat16 values) where they take it: float32 models, and
    # bfloat16 steps through fbgemm's float16 copies; elsewhere in the model's dtype, which they take as it is.
    fp16 = getattr(attn0.qkv_proj, "fp16", None) is not None and t <= FP16_KERNEL_MAX_ROWS
    wide = torch.float32 if not bf or fp16 else dtype
    h = torch.empty(t, hidden, dtype=wide)  # [T, hidden] each norm's output
    q = torch.empty(t, heads, head_dim, dtype=dtype)  # [T, heads, head_dim] rotated queries
    a = torch.empty(t, heads * head_dim, dtype=wide)  # [T, heads * head_dim] attention output
    inter = (mlp0.gate_up_proj.out_features // 2 if mlp0.gate_up_proj is not None
             else mlp0.gate_proj.out_features)
    m = torch.empty(t, inter, dtype=wide)  # [T, intermediate] SiLU(gate) * up
    cos, sin = rope.cos.contiguous(), rope.sin.contiguous()  # [T, 1, head_dim]
    tables = batch.decode_block_tables
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    ctx, slots = batch.decode_context_lens.contiguous(), batch.slot_mapping.contiguous()
    md, wd = _code(x), _code(h)
    xp, hp, qp, ap, mp = x.data_ptr(), h.data_ptr(), q.data_ptr(), a.data_ptr(), m.data_ptr()
    cos_p, sin_p, slots_p, tables_p, ctx_p = (cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                              ctx.data_ptr())
    table_stride, block_size = tables.stride(0), kv_caches[0][0].shape[1]
    rope_write, attend, add_norm, silu_mul = (lib.ab_qkv_rope_write, lib.ab_decode_attention, lib.ab_add_rms_norm,
                                              lib.ab_silu_mul)
    first = plan[0].input_norm
    lib.ab_rms_norm(xp, md, t, hidden, first.weight, first.code, first.eps, bf, hp, wd)
    last = len(plan) - 1
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(plan, kv_caches)):
        kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
        qkv = layer.qkv(h)  # [T, (heads + 2 kv_heads) * head_dim]
        rope_write(qkv.data_ptr(), _code(qkv), t, heads, kv_heads, head_dim, cos_p, sin_p, kp, vp, slots_p, qp, md, bf)
        attend(qp, kp, vp, md, tables_p, table_stride, ctx_p, t, heads, kv_heads, head_dim, block_size, layer.scale,
               ap, wd, bf)
        o = layer.o(a)  # [T, hidden]
        norm = layer.post_norm
        add_norm(o.data_ptr(), _code(o), xp, md, t, hidden, norm.weight, norm.code, norm.eps, bf, hp, wd)
        if layer.gate_up is not None:
            gate = layer.gate_up(h)  # [T, 2 * intermediate]: gate | up
            up_ptr, stride = gate.data_ptr() + inter * gate.element_size(), 2 * inter
        else:
            gate, up = layer.gate(h), layer.up(h)
            up_ptr, stride = up.data_ptr(), inter
        silu_mul(gate.data_ptr(), up_ptr, _code(gate), stride, t, inter, bf, mp, wd)
        down = layer.down(m)  # [T, hidden]
        if i < last:  # the residual sum and the next layer's input norm
            norm = plan[i + 1].input_norm
            add_norm(down.data_ptr(), _code(down), xp, md, t, hidden, norm.weight, norm.code, norm.eps, bf, hp, wd)
        else:  # the residual sum alone: the final norm reads only the rows whose logits are wanted
            add_norm(down.data_ptr(), _code(down), xp, md, t, hidden, None, 0, 0.0, bf, hp, wd)
    return x
