"""The lean CPU decode step: every decoder layer as four matrix products and five calls of ``lean_cpu.c``,
the products themselves by ``lean_gemv.c`` where the weights are plain.

**Why.** A one-row decode step reads every weight once, so it should take about as long as reading them. In
eager torch it did not: SmolLM2-135M's one-row step ran ~1,300 torch ops, 42 a layer (the norms' casts and
weight products, rotary's products, roll and sum, the cache writes, the gathers and views around the
attention, the SiLU and its product, the residual adds, the casts around fbgemm's float16-weight products),
and on a 2-vCPU Zen 4 VM the ones between the products took ~7.7 of a bfloat16 step's ~19 ms, against a
memory floor of ~7.8 ms (``profiles/lean-cpu-step-amd-epyc-zen4-2core``). And torch's one-row products read
float32 weights at 11-20 GB/s there, where a ``sum()`` reads ~30 (``profiles/lean-products-amd-epyc-zen4-2core``).
Here a layer is:

    h = rms_norm(x) * w                    ab_rms_norm (first layer) / ab_add_rms_norm (the residual sum too)
    qkv = qkv_proj(h)                      ab_gemv on the plain weight (else the linear's own: int8, oneDNN)
    q = rope(q); cache[slot] = rope(k), v  ab_qkv_rope_write
    a = attention(q, cache)                ab_decode_attention (reads the paged cache through the block table)
    o = o_proj(a)                          ab_gemv
    x += o; h = rms_norm(x) * w            ab_add_rms_norm
    gate, up = gate_up_proj(h)             ab_gemv
    m = silu(gate) * up                    ab_silu_mul
    d = down_proj(m)                       ab_gemv
    x += d (and the next layer's norm)     ab_add_rms_norm

and the LM head of the step's (at most ``lean_max_rows``) logits rows is ``ab_gemv`` too (``lean_logits``).

**Numerics.** Each kernel rounds where the torch ops it replaces round (``lean_cpu.c``): in float32 nothing
is rounded and the results are the torch path's up to the order of float32 sums (the norm's variance, the
products, the attention's dot products and softmax, which also differs from ``scaled_dot_product_attention``'s
blocked one); in bfloat16 they differ from it only where such a sum's last bit moves a value across a bfloat16
rounding boundary, and the attention's weighted sum of values is taken in float32 where the fused SDPA kernel
rounds its probabilities to bfloat16 first. The products take float32 rows holding the model's values (exact)
and return float32 sums, rounded by the kernel that reads them, as ``.to(dtype)`` would round torch's.

**Where.** CPU models whose step is decode rows only (no prefill chunk; a verify step's rows, one a position,
are decode rows), at most the model's ``lean_max_rows`` rows (``LEAN_MAX_ROWS``, more where measured), in
float32 or bfloat16, without Qwen3's q/k norms, with q/k/v fused (``fused_projections``), outside
``torch.compile`` (``compile_decode`` keeps the traced torch ops), where ``lean_kernels.library()`` built.
Products by ``lean_gemv.c`` where the weight is plain (``plain_weight``: bfloat16 models always; float32 ones
packed for oneDNN keep their plain weights for it, ``packed_linears.LEAN_PLAIN_MAX_BYTES``).
``ASYNCBATCH_CPU_LEAN_STEP=0`` keeps the torch ops everywhere, ``ASYNCBATCH_CPU_LEAN_PRODUCTS=0`` each linear's
own product inside the lean step (to compare).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from asyncbatch.model import lean_kernels
from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.rope import RopeTables

# Measured on a 2-vCPU Zen 4 (profiles/lean-products-amd-epyc-zen4-2core, rows_sweep): bfloat16 steps of 1-5 rows
# took 0.55-0.92x the torch ops' time at contexts of 128-2,048 a row (0.43-0.64x at 8,192); float32 0.42-0.71x.
# Five rows: a verify step of one request with four drafts (speculation's default), or five requests' decode
# rows. The limit on CPUs where more was not measured (``lean_max_rows``). No limit on context: the attention
# reads each row's blocks in place (its KV heads in one pass, chunks of 256 positions over the threads), and
# torch's paged attention gathers the pages each step, which grows faster.
LEAN_MAX_ROWS = 5
# Where more rows were measured, with the lean step's own products: AVX512-BF16 without AMX (the Zen 4 VM,
# 2026-12-06, profiles/lean-products-amd-epyc-zen4-2core/row-limit). Steps alone (rows_sweep, contexts of 128-2,048
# a row): bfloat16 6-10 rows 0.72-0.99x the torch ops' time (12 rows 0.58-1.01x, 16 up to 1.16x), float32 6-16 rows
# 0.19-0.97x. Through the engine at short contexts (batch_rows): bfloat16 batches of 6 / 8 / 10 decode steps
# 0.77 / 0.75 / 0.88x, float32 6 / 8 0.71 / 0.77x but 12 / 16 0.99 / 1.02x (three weight passes and more against
# oneDNN's one): ten rows in both. On AMX CPUs oneDNN's bfloat16 product gains most from more rows, and on CPUs
# without AVX-512 the products run a portable loop: neither was measured past five rows.
MEASURED_MAX_ROWS = {torch.float32: 10, torch.bfloat16: 10}
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


def lean_max_rows(dtype: torch.dtype, products: bool, flags: frozenset[str]) -> int:
    """The most decode rows a lean step of a ``dtype`` model takes on a CPU with the feature ``flags`` (the
    hardware's), with (``products``) or without its own products: ``MEASURED_MAX_ROWS`` where measured, else
    ``LEAN_MAX_ROWS``."""
    if products and dtype in MEASURED_MAX_ROWS and "avx512_bf16" in flags and "amx_bf16" not in flags:
        return MEASURED_MAX_ROWS[dtype]
    return LEAN_MAX_ROWS


def applies(batch: ForwardBatch, max_rows: int) -> bool:
    """Whether this step's batch is one the lean step serves, at most ``max_rows`` decode rows (the model's
    ``lean_max_rows``; the model already has its kernels)."""
    if torch.compiler.is_compiling():  # first: a traced shape test would specialise the graph's dynamic sizes
        return False
    rows = batch.num_decode
    return 0 < rows <= max_rows and not batch.prefill_rows and batch.input_ids.shape[0] == rows


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
    # Whether the q/k/v product takes float32 rows (``_product``): then the layer's norms and kernels write their
    # outputs as float32 (holding the model's values) for it and the other products, each of which takes either.
    float32_inputs: bool


def plain_weight(linear: nn.Module) -> torch.Tensor | None:
    """``linear``'s weight as ``lean_gemv.c`` reads it (``[out, in]``, row-major, float32 or bfloat16 values on
    the CPU: ``nn.Linear``'s, the plain copy ``PackedLinear`` keeps, the emulated-bfloat16 one), or None
    (int8 codes, a float32 ``PackedLinear`` holding only oneDNN's packed copy)."""
    weight = getattr(linear, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in DTYPE_CODES
            or weight.device.type != "cpu" or not weight.is_contiguous()):
        return None
    return weight


def _kernel_product(lib, weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``rows @ weight.T + bias`` by ``lean_gemv.c``: float32 rows (``[T, in]``) in, float32 ``[T, out]`` out,
    the weight's rows split over torch's threads."""
    n, k = weight.shape
    w_ptr, w_code = weight.data_ptr(), _code(weight)
    b_ptr, b_code = (None, 0) if bias is None else (bias.data_ptr(), _code(bias))
    gemv = lib.ab_gemv

    def kernel_product(h: torch.Tensor) -> torch.Tensor:
        h = h if h.dtype == torch.float32 and h.is_contiguous() else h.float().contiguous()
        out = torch.empty(h.shape[0], n)
        gemv(h.data_ptr(), h.shape[0], k, w_ptr, w_code, b_ptr, b_code, n, out.data_ptr(), torch.get_num_threads())
        return out
    return kernel_product


def head_applies(model: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether the LM head of these ``[R, hidden]`` states goes through ``lean_logits`` (``compute_logits`` asks
    after its int8 and emulated-bfloat16 heads): a model with the kernels and their products
    (``model.lean_products``), at most ``model.lean_max_rows`` rows, outside ``torch.compile``."""
    # is_compiling first: a traced shape test would specialise the graph's dynamic sizes (``applies``).
    return (not torch.compiler.is_compiling() and model.lean_kernels is not None and model.lean_products
            and hidden.shape[0] <= model.lean_max_rows)


def lean_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head by the library's product (built at first use, kept as ``model.lean_head``): float32 logits
    ``[R, vocab]``, rounded to the model's dtype first as its torch head's output is."""
    if model.lean_head is None:
        model.lean_head = _kernel_product(model.lean_kernels, model.output_weight, None)
    logits = model.lean_head(hidden)
    return logits if hidden.dtype == torch.float32 else logits.to(hidden.dtype).float()


def _product(linear: nn.Module, dtype: torch.dtype, lib,
             products: bool) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
    """``linear`` as a function of a step's rows, and whether it takes them as float32 (holding ``dtype``'s
    values) and returns float32 unrounded (the next kernel rounds): the library's own product where the weight
    is plain (``plain_weight``) and ``products`` (``model.lean_products``); every other path (int8, oneDNN's
    packed float32 copy alone, any linear with ``ASYNCBATCH_CPU_LEAN_PRODUCTS=0``) gets ``dtype`` and returns a
    dense tensor in it."""
    weight = plain_weight(linear) if products else None
    if weight is not None:
        return _kernel_product(lib, weight, getattr(linear, "bias", None)), True

    def product(h: torch.Tensor) -> torch.Tensor:
        out = linear(h if h.dtype == dtype else h.to(dtype))
        return out if out.is_contiguous() else out.contiguous()
    return product, False


def _norm(norm: nn.Module) -> LeanNorm:
    return LeanNorm(norm.weight.data_ptr(), _code(norm.weight), norm.eps)


def layer_plan(model: nn.Module, dtype: torch.dtype, lib) -> list[LeanLayer]:
    """The model's layers as ``LeanLayer``s, built at its first lean step and kept on it as ``lean_plan`` (its
    weights do not move; a profiler may wrap the products it holds)."""
    plan = model.lean_plan
    if plan is None:
        plan = []

        def product(linear: nn.Module | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
            return None if linear is None else _product(linear, dtype, lib, model.lean_products)[0]

        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = mlp.gate_up_proj is not None  # (fusing deletes gate_proj and up_proj)
            qkv, wide = _product(attn.qkv_proj, dtype, lib, model.lean_products)
            plan.append(LeanLayer(qkv, product(attn.o_proj), product(mlp.gate_up_proj),
                                  product(None if fused else mlp.gate_proj), product(None if fused else mlp.up_proj),
                                  product(mlp.down_proj), attn.scale, _norm(layer.input_layernorm),
                                  _norm(layer.post_attention_layernorm), wide))
        model.lean_plan = plan
    return plan


def check_cache_indices(tables: torch.Tensor, ctx: torch.Tensor, slots: torch.Tensor, num_blocks: int,
                        block_size: int) -> None:
    """Raise ``IndexError`` where a step's slot (``slots``, ``[T]``) or a block its rows read (the first
    ``ceil(ctx[b] / block_size)`` entries of ``tables[b]``) lies outside a cache of ``num_blocks`` blocks, as torch's
    indexing does on the same step. The C kernels write and read the caches at these indices unchecked, so a wrong
    table would corrupt memory there instead of raising; once a step, a few microseconds against milliseconds."""
    for name, index in (("block tables", tables), ("context lengths", ctx), ("slot_mapping", slots)):
        if index.dtype != torch.int64:  # the kernels read int64
            raise TypeError(f"the lean step's {name} must be int64, got {index.dtype}")
    s = slots.numpy()
    if s.size and (s.min() < 0 or s.max() >= num_blocks * block_size):
        bad = s[(s < 0) | (s >= num_blocks * block_size)]
        raise IndexError(f"slot_mapping holds slot {int(bad[0])}, outside the KV cache's "
                         f"{num_blocks * block_size} slots [0, {num_blocks * block_size})")
    lens, table = ctx.numpy(), tables.numpy()
    if not lens.size:
        return
    needed = -(-lens // block_size)  # [B] blocks each row reads
    if needed.max() > table.shape[1]:
        row = int(needed.argmax())
        raise IndexError(f"row {row}'s context of {int(lens[row])} tokens needs {int(needed[row])} blocks; its block "
                         f"table holds {table.shape[1]}")
    used = table[:len(lens)][np.arange(table.shape[1]) < needed[:, None]]
    if used.size and (used.min() < 0 or used.max() >= num_blocks):
        bad = used[(used < 0) | (used >= num_blocks)]
        raise IndexError(f"a block table holds block {int(bad[0])}, outside the KV cache's {num_blocks} blocks")


def cache_indices(batch: ForwardBatch, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's decode block tables (rows dense), context lengths and slots as the C kernels read them, checked
    against a cache shaped as ``k_cache`` (``check_cache_indices``)."""
    tables = batch.decode_block_tables
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    ctx, slots = batch.decode_context_lens.contiguous(), batch.slot_mapping.contiguous()
    check_cache_indices(tables, ctx, slots, k_cache.shape[0], k_cache.shape[1])
    return tables, ctx, slots


def lean_layers(model: nn.Module, lib, x: torch.Tensor, batch: ForwardBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rope: RopeTables) -> torch.Tensor:
    """Every decoder layer of ``model`` over the embedded tokens ``x`` (``[T, hidden]``, the model's dtype,
    updated in place as the residual stream); returns it."""
    layers = model.model.layers
    attn0 = layers[0].self_attn
    dtype, bf = x.dtype, int(x.dtype == torch.bfloat16)
    plan = layer_plan(model, dtype, lib)
    t, hidden = x.shape
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    # The products' inputs in float32 (exact for bfloat16 values) where they take it (float32 models, the
    # library's products, fbgemm's); elsewhere in the model's dtype, which they take as it is.
    wide = torch.float32 if not bf or plan[0].float32_inputs else dtype
    h = torch.empty(t, hidden, dtype=wide)  # [T, hidden] each norm's output
    q = torch.empty(t, heads, head_dim, dtype=dtype)  # [T, heads, head_dim] rotated queries
    a = torch.empty(t, heads * head_dim, dtype=wide)  # [T, heads * head_dim] attention output
    inter = model.config.intermediate_size  # (emulated bfloat16's linears carry no ``out_features``)
    m = torch.empty(t, inter, dtype=wide)  # [T, intermediate] SiLU(gate) * up
    cos, sin = rope.cos.contiguous(), rope.sin.contiguous()  # [T, 1, head_dim]
    tables, ctx, slots = cache_indices(batch, kv_caches[0][0])
    md, wd = _code(x), _code(h)
    xp, hp, qp, ap, mp = x.data_ptr(), h.data_ptr(), q.data_ptr(), a.data_ptr(), m.data_ptr()
    cos_p, sin_p, slots_p, tables_p, ctx_p = (cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                              ctx.data_ptr())
    table_stride, block_size, threads = tables.stride(0), kv_caches[0][0].shape[1], torch.get_num_threads()
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
               ap, wd, bf, threads)
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
