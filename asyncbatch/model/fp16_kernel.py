"""bfloat16 weights multiplied by fbgemm's float16-weight kernel in CPU steps of one or two rows.

**Why.** A one-row decode step reads every weight once, so its linears should run at the memory's read rate.
oneDNN's packed bfloat16 product (``packed_linears``) does not at one row: on a 2-vCPU AMD EPYC Zen 4 (AVX512-BF16)
SmolLM2-135M's 150 decoder products and its LM head, weights cold as in a real step, read at 13-16 GB/s where a
``sum()`` reads at 31 and fbgemm's float16-weight product (``quantized.linear_dynamic_fp16``, the kernel behind
torch's dynamic float16 quantization) at 18-20: 17.2 -> 13.3 ms at one row, 20.3 -> 14.8 at two, about equal at
three and four (oneDNN is faster there than at one row), and oneDNN ahead from eight; the whole one-row step 29.1
-> 22.9 ms, one request's decode 1.14-1.22x (``profiles/fp16-weight-kernel-amd-epyc-zen4-2core/``). So steps of
at most ``FP16_KERNEL_MAX_ROWS`` rows take it; larger ones keep oneDNN's packed copy or the plain weight.

**Why it is the same product.** A bfloat16 weight has 8 significant bits and float16 has 11, so every weight of
magnitude in [2^-17, 65,280] (and zero) converts to float16 exactly; a linear with a larger or non-finite value
stays on the oneDNN path (``pack_fp16``). Smaller values fall among float16's subnormals, spaced 2^-24 apart, and
move by at most 2^-25 each: a product's float32 sum moves by at most 2^-25 times the row's magnitude over those
weights, far under one bfloat16 step of any output that is not itself tiny (all 134 M of the default model's
decoder and head weights convert exactly). The kernel multiplies the row in float32 (a bfloat16 row converts
exactly) by those weights and sums in float32, as oneDNN's bfloat16 product does, and rounds the result to
bfloat16 once: the order of the float32 sums differs, which moves an output by one bfloat16 step where it sits at
a rounding boundary (``tests/test_loader.py`` checks one step at most).

**Its cost** is a third copy of each decoder weight and of the LM head (the plain weight serves steps above
``packed_linears.PACKED_MAX_ROWS`` rows, oneDNN's packed copy the steps between): +257 MiB for SmolLM2-135M. So it
is held by default only where it was measured to pay (``FP16_KERNEL_VENDORS``) and only for models whose copy is
at most ``FP16_KERNEL_MAX_BYTES``, and not for a model whose one- to five-row steps the lean CPU step multiplies
by its plain bfloat16 weights (``lean_step``: faster than this kernel where both were measured, with no copy);
``ASYNCBATCH_BF16_FP16_KERNEL=1`` holds it for any model on any CPU whose torch has the kernel, ``=0`` never.
"""

from __future__ import annotations

import functools
import os

import torch

from asyncbatch.model.cpu_features import cpu_vendor

FP16_KERNEL_ENV = "ASYNCBATCH_BF16_FP16_KERNEL"
FP16_KERNEL_MAX_ROWS = 2  # measured: 0.73-0.84x oneDNN's time at one and two rows, 0.93-0.99x at three, 0.98-1.34x at four
FP16_KERNEL_VENDORS = ("AuthenticAMD",)  # where it was measured; Intel's AMX oneDNN path is unmeasured against it
FP16_KERNEL_MAX_BYTES = 1 << 30  # the extra copy held without being asked: models up to ~500M parameters
FP16_EXACT_MAX = 65280.0  # the largest bfloat16 value float16 holds (float16's largest is 65,504)


def wants_fp16_kernel(copy_bytes: int, lean_products: bool = False) -> bool:
    """Whether a bfloat16 model whose float16 copies would take ``copy_bytes`` gets them; ``lean_products``: the
    lean CPU step will multiply its small steps by the plain weights (module docstring)."""
    asked = os.environ.get(FP16_KERNEL_ENV)
    if asked == "0":
        return False
    if asked != "1" and (cpu_vendor() not in FP16_KERNEL_VENDORS or copy_bytes > FP16_KERNEL_MAX_BYTES
                         or lean_products):
        return False
    return fp16_kernel_works()


@functools.cache
def fp16_kernel_works() -> bool:
    """One small product through the kernel equal to ``F.linear``'s in bfloat16: the kernel is fbgemm's, so x86
    builds only, and a torch without it, or with a quantized engine that lacks it, keeps the oneDNN path."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, 32, generator=gen).to(torch.bfloat16)
    try:
        packed = pack_fp16(weight, None)
        got = None if packed is None else fp16_product(x, packed)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    want = torch.nn.functional.linear(x, weight).float()
    return got is not None and torch.allclose(got.float(), want, rtol=2**-7, atol=want.abs().max().item() * 2**-16)


def pack_fp16(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.ScriptObject | None:
    """fbgemm's packed float16 copy of a bfloat16 ``[out, in]`` weight (and its bias, in float32), or None when the
    weight has a value float16 cannot hold (beyond ``FP16_EXACT_MAX`` in magnitude, or not finite): that linear
    stays on the oneDNN path. Values under 2^-17 in magnitude become float16's nearest subnormal (module
    docstring)."""
    w = weight.detach()
    if w.numel() and not (torch.isfinite(w).all() and w.abs().max() <= FP16_EXACT_MAX):
        return None
    return torch.ops.quantized.linear_prepack_fp16(w.float(), None if bias is None else bias.detach().float())


def fp16_product(x: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """``x @ weight.T + bias`` for a ``[rows, in]`` bfloat16 ``x``, in ``x``'s dtype (float32 sums, one rounding)."""
    return torch.ops.quantized.linear_dynamic_fp16(x.float(), packed).to(x.dtype)
