"""bfloat16 linears on oneDNN's packed weight layout, on CPUs with bfloat16 dot products.

torch's ``F.linear`` on bfloat16 weights hands oneDNN a plain row-major weight, which oneDNN reorders into
its blocked layout inside every call. Packing each weight once at load (``mkldnn._reorder_linear_weight``)
and calling the packed product (``mkldnn._linear_pointwise``) skips that. Measured on a 2-core Xeon with AMX,
2 threads, SmolLM2-135M's 150 decoder linears (``profiles/cpu-kernel-threads-intel-xeon-2core``): 20.0 ->
13.4 ms at one row, 19.8 -> 14.0 at 8, 22.9 -> 17.3 at 32, 40.5 -> 32.7 at 128, 126 -> 81 at 512. Up to 32 rows
the outputs are bit-identical to ``F.linear``'s; above, they differ in bfloat16 rounding (another blocking of
the float32 sums), enough to move greedy tokens at near-ties after a prefill. So the packed product serves
steps of at most ``PACKED_MAX_ROWS`` rows (decode steps of small batches, where the step is weight reads), and
larger ones (prefill chunks, large batches) keep ``F.linear`` on the plain weight: the same numbers as
before, at the cost of holding each decoder weight twice (the packed copy is not a parameter).

The LM head gets a packed copy of its weight too (``PackedBf16Head``; the tied embedding table stays plain for
the lookup): SmolLM2's 49,152 x 576 head at one row, 2 threads, 2.54 -> 1.27 ms, bit-identical. Not on a CPU
that emulates bfloat16 (``emulated_bf16``), not with ``compile_decode`` (the compiler does not trace opaque
oneDNN tensors), nor where oneDNN is missing. ``ASYNCBATCH_BF16_PACKED=0`` keeps ``F.linear`` everywhere (to
compare).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from asyncbatch.model.emulated_bf16 import swap_decoder_linears

PACKED_ENV = "ASYNCBATCH_BF16_PACKED"
PACKED_MAX_ROWS = 32  # the most rows measured bit-identical to F.linear (module docstring)


def packs_bf16(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a bfloat16 model on ``device`` gets ``PackedBf16Linear`` (the caller rules out emulation)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or os.environ.get(PACKED_ENV) == "0":
        return False
    return torch.backends.mkldnn.is_available() and _packed_product_works()


@functools.cache
def _packed_product_works() -> bool:
    """One small packed product equal to ``F.linear``'s (the ops are internal to torch: a build without them,
    or one where they changed, keeps the plain path)."""
    try:
        weight = torch.randn(16, 32).to(torch.bfloat16)
        x = torch.randn(2, 32).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return torch.equal(out, nn.functional.linear(x, weight))


class PackedBf16Linear(nn.Module):
    """``nn.Linear`` whose steps of at most ``PACKED_MAX_ROWS`` rows use a copy of the weight packed for oneDNN
    (the module docstring says why). The packed copy is an opaque oneDNN tensor held as a plain attribute;
    ``weight`` stays the parameter (what a step reads either way, so ``weight_bytes`` counts it once)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
        # A fused group (gate/up): the output sizes of its parts, multiplied apart above PACKED_MAX_ROWS so that
        # large steps keep the separate linears' numbers (``pack_bf16_linears``); None: one product.
        self.splits: tuple[int, ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's activations are [T, hidden]: no reshape and view back (two ops a linear)
            return self._forward_2d(x)
        return self._forward_2d(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def _forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        if self.splits is None or x.shape[0] <= PACKED_MAX_ROWS:
            return _product(x, self.packed, self.weight, self.bias)
        weights = self.weight.split(self.splits)
        biases = (None,) * len(weights) if self.bias is None else self.bias.split(self.splits)
        return torch.cat([nn.functional.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


class PackedBf16Head(nn.Module):
    """The LM head's product through a packed copy of the model's ``output_weight`` for at most
    ``PACKED_MAX_ROWS`` rows, ``F.linear`` on the plain weight above. It holds only the packed copy (an opaque
    attribute, not a parameter): the plain weight stays the model's (the tied embedding table, or ``lm_head``)
    and is passed in, so the weight is counted, moved and saved once."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> ``[R, vocab]`` in the weight's dtype (``weight``: the plain ``output_weight``)."""
        return _product(hidden, self.packed, weight, None)


def _product(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [R, K]`` by the weight: through its ``packed`` copy up to ``PACKED_MAX_ROWS`` rows, ``F.linear`` on the
    plain ``weight`` above (the module docstring says why)."""
    if x.shape[0] > PACKED_MAX_ROWS:
        return nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_bf16_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of a loaded bfloat16 ``CausalLM``'s decoder for ``PackedBf16Linear`` and give
    its LM head a ``PackedBf16Head`` (in place); returns how many linears were swapped.

    A fused gate/up (``loader.load_model`` fuses it for packing) is one packed product up to
    ``PACKED_MAX_ROWS`` rows, bit-identical to the two separate ones (oneDNN computes each output from the same
    dot product; checked at 1, 8 and 32 rows) and one call fewer a layer (SmolLM2 at one row: 78 -> 65 us for
    gate, up and the activation); above, its halves are multiplied apart: ``F.linear`` on the fused weight
    rounds differently at 2,048 rows, and large steps keep the separate linears' numbers."""
    model.packed_lm_head = PackedBf16Head(model.output_weight)
    swapped = swap_decoder_linears(model, lambda linear: PackedBf16Linear(linear.weight, linear.bias))
    for layer in model.model.layers:
        gate_up = layer.mlp.gate_up_proj
        if gate_up is not None:
            gate_up.splits = (gate_up.out_features // 2,) * 2
    return swapped
