"""bfloat16 on a CPU without bfloat16 dot products: bfloat16 numbers, float32 kernels.

Where the CPU lacks AVX512-BF16 / AMX / Arm BF16 (``cpu_features``), torch runs a bfloat16 matmul in a
generic kernel that converts as it goes: on an AMD EPYC (Zen 3, AVX2), one thread, a 576 x 1536 linear
at 48 rows took 21.6 ms against 2.6 ms in float32, and SmolLM2's LM head (576 x 49,152) at 8 rows 84 ms.
``dtype="auto"`` never picks bfloat16 there, but a user (or a test of the bfloat16 path) can ask for it.

The emulation keeps every number a bfloat16 one and does the multiplications with float32 kernels:

* each linear's weight is rounded to bfloat16 once and held in float32 (the GEMM reads it without
  converting; values identical to the bfloat16 weight's);
* its bfloat16 input converts to float32 exactly; the float32 GEMM accumulates in float32; the output is
  rounded to bfloat16, which is what a native kernel with float32 accumulation returns (up to the order
  of the float32 sums);
* everything between the linears (norms, rotary, attention, the KV cache) stays bfloat16 as it was.

So a step gives what a bfloat16-capable CPU's kernels give, at float32's speed and float32's weight
memory. The LM head returns float32 logits, as the native path's ``.float()`` does after its bfloat16
product; here the product is not rounded to bfloat16 first (logits are sampled in float32 either way).

``ASYNCBATCH_BF16_EMULATION``: ``1`` emulates on any CPU, ``0`` never (torch's own bfloat16 kernels,
to compare); unset, it follows the CPU's real flags (not ``ASYNCBATCH_CPU_FLAGS``, which fakes what
``auto`` sees, not what the hardware runs).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from asyncbatch.model.cpu_features import NATIVE_BF16_FLAGS, hardware_cpu_flags

EMULATION_ENV = "ASYNCBATCH_BF16_EMULATION"


def emulates_bf16(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model in ``dtype`` on ``device`` runs its linears through ``EmulatedBf16Linear``."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    forced = os.environ.get(EMULATION_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return not any(flag in hardware_cpu_flags() for flag in NATIVE_BF16_FLAGS)


class EmulatedBf16Linear(nn.Module):
    """``nn.Linear`` in bfloat16 numbers on float32 kernels (the module docstring says how)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16).float(), requires_grad=False)
        self.bias = (None if bias is None
                     else nn.Parameter(bias.detach().to(torch.bfloat16).float(), requires_grad=False))
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(self.out_dtype)


def emulate_bf16_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of a loaded bfloat16 ``CausalLM`` for ``EmulatedBf16Linear`` and give it
    a float32 LM head of the same values (in place); returns how many linears were swapped."""
    swapped = swap_decoder_linears(model, lambda linear: EmulatedBf16Linear(linear.weight, linear.bias))
    model.emulated_lm_head = EmulatedBf16Linear(model.output_weight, None, out_dtype=torch.float32)
    if not model.tie_word_embeddings:
        del model.lm_head  # the emulated head holds its values
    return swapped


def swap_decoder_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every ``nn.Linear`` of a ``CausalLM``'s decoder (not its LM head) by ``make(linear)``, in place;
    returns how many were replaced."""
    swapped = 0
    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
                swapped += 1
    return swapped
