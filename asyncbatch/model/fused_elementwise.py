"""Fused elementwise kernels for CUDA steps: residual add + RMSNorm, rotary, SiLU x up.

Why: on an H200, once the split decode kernel took attention down, the largest share of a captured
decode step of SmolLM2-135M (256 rows, 30 layers) was elementwise kernels: 874 of 2,688 us, about 14
small kernels a layer at ~2 us each (the norm's casts and weight product, rotary's two products, roll and
sum on a strided view, SiLU, the product with up, the residual adds;
profiles/gpu-check-nvidia-h200-2026-12-04-second). Here they are four a layer: ``add_rms_norm`` twice
(the residual sum and the next norm in one pass), ``rope`` and ``silu_mul``; and ``enable`` fuses the
gate and up projections into one product too (``silu_mul`` reads its halves), one matrix product a layer
fewer, as the CPU's packed and quantized weights already have it.

Numerics: each kernel rounds where the torch ops it replaces round, so in float32 the results are the
reference's up to the order of the norm's sum, and in bfloat16 they differ from it only where that order
moves a value across a rounding boundary:

* ``add_rms_norm``: the residual sum rounded to the activations' dtype (torch's ``add``); the norm in
  float32 from that rounded sum; the normalised value rounded to the dtype, then times the weight, rounded
  again (transformers' ``RMSNorm``; ``llama.RMSNorm``).
* ``rope``: ``x * cos`` and ``swap_halves(x) * signed_sin`` each rounded, then their sum (``rope.apply_rope``).
* ``silu_mul``: SiLU of the gate rounded, then the product with up (``F.silu(gate) * up``).

Chosen by ``ASYNCBATCH_FUSED_ELEMENTWISE=1`` (``cuda_executor.FUSED_ELEMENTWISE_ENV``) until a GPU has
timed them (``scripts/gpu_check.sh`` profiles a step with and without them); the engine's CUDA executor then
calls ``enable``. Launch only (no host sync): they are captured
into CUDA graphs like the rest of a step. Tested against the torch ops in Triton's CPU interpreter (float32;
``tests/test_fused_elementwise.py``) and on a GPU by ``gpu_check.sh``.
"""

import sys

import torch
import triton
import triton.language as tl
from torch import nn

from asyncbatch.model.fused_projections import ALL_GROUPS, fuse_projections

_SILU_BLOCK = 1024  # columns of the intermediate size per program


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s,
                         n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_st, stride_ot,
                 stride_oh, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, DIM_PAD)
    mask = d < HEAD_DIM
    swapped = (d + HEAD_DIM // 2) % HEAD_DIM
    row = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(row + d, mask=mask, other=0.0)
    xs = tl.load(row + swapped, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + token * stride_ct + d, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_st + d, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(dtype)
    b = (xs.to(tl.float32) * sin.to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, (a.to(tl.float32) + b.to(tl.float32)).to(dtype),
             mask=mask)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(dtype), mask=mask)


def enable(model: nn.Module) -> None:
    """Run a loaded ``CausalLM`` through these kernels from its next forward on (``CausalLM.fused_elementwise``),
    with its gate and up projections fused into one product (in place, for good: no weight is held twice)."""
    fuse_projections(model, ALL_GROUPS)
    model.fused_elementwise = sys.modules[__name__]


def _check_rows(t: torch.Tensor, name: str) -> None:
    """The kernels step through a row's elements one by one: its last dimension must be contiguous."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(s) * weight, s)`` with ``s = x + residual`` (``x`` itself without a residual), ``[T, n]`` each,
    in ``x``'s dtype: the decoder layer's residual sum and the next norm in one pass over the rows."""
    _check_rows(x, "x")
    t, n = x.shape
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    if t == 0:
        return out, total
    if residual is not None:
        _check_rows(residual, "residual")
    res = x if residual is None else residual
    _add_rms_norm_kernel[(t,)](x, res, weight, out, total, x.stride(0), res.stride(0), out.stride(0),
                               total.stride(0), n, eps, HAS_RESIDUAL=residual is not None,
                               BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return out, total


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope.apply_rope`` as one kernel: ``x [T, heads, head_dim]`` (any row and head strides, e.g. the q and
    k heads of a fused q/k/v product) with the step's tables ``[T, 1, head_dim]`` → a new contiguous tensor."""
    _check_rows(x, "x")
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    _rope_kernel[(t, h)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                         out.stride(0), out.stride(1), HEAD_DIM=d, DIM_PAD=triton.next_power_of_2(d),
                         num_warps=1)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` as one kernel: ``[T, n]`` each (views of one fused gate/up product, or two)."""
    _check_rows(gate, "gate")
    _check_rows(up, "up")
    t, n = gate.shape
    out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
    if t == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n,
                                                 BLOCK=block, num_warps=4)
    return out
