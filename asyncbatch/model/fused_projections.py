"""q/k/v and gate/up as one linear each: the one fusion every weight precision goes through.

q, k and v read the same input, and so do gate and up. ``fuse_projections`` replaces each group of a
loaded ``CausalLM``'s decoder layer by one module, ``qkv_proj`` (outputs ``[q | k | v]``) and
``gate_up_proj`` (``[gate | up]``), and removes the separate ones: one matmul instead of three and two.
Which groups: ``FLOAT_GROUPS`` at load for every model, ``ALL_GROUPS`` for quantized weights and for weights
packed for oneDNN (``packed_linears``: bfloat16, and float32 on AMD). Invariants:

* Checkpoints keep their names: the model is built and loaded with ``q_proj`` ... ``up_proj`` (what a
  Hugging Face state dict holds), and fusion happens after loading (``loader.load_model``).
* No weight is held twice: the fused weight is a concatenation, and the separate linears are deleted
  as each layer is fused, so the model's memory is the same (peak: one layer's q/k/v more).
* The arithmetic is the separate linears': each output row of a fused product is the same dot product
  of the same input, so float results equal the separate ones up to the GEMM's own blocking (the tests
  check logits against the unfused model per architecture).
* Later module swaps see the fused linears: ``quantization.quantize_model`` quantizes ``qkv_proj``
  and ``gate_up_proj`` as they are (per-output-row scales make that the same arithmetic as separate
  ones), and ``emulated_bf16`` swaps them like any ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

# The separate projections of each group, in the fused output's order: (parent module, fused name, parts).
FUSED_GROUPS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))
ALL_GROUPS = ("qkv_proj", "gate_up_proj")
# Float weights (float32, bfloat16, emulated bfloat16) fuse q/k/v only. A fused gate/up product (576 x 3072
# for the default model) ran as fast as two at one row but 10-15 % slower at 8-32 rows in float32 on the
# AMD EPYC (MKL picks another blocking; profiles/lean-decode-step-amd-epyc-2core/), and saves one call
# per layer; the quantized kernels fuse both (``quantization.quantize_model``), and so do packed weights
# (oneDNN's product, not MKL's), whose bfloat16 steps above 32 rows multiply the halves apart
# (``packed_linears.pack_linears``).
FLOAT_GROUPS = ("qkv_proj",)


def concat_linears(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [sum N_i, K], bias [sum N_i] or None)`` of linears sharing an input; a missing bias among
    biased ones is zeros (transformers builds q/k/v biases together, so that is for completeness)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if all(lin.bias is None for lin in linears):
        return weight, None
    bias = torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
                      for lin in linears])
    return weight, bias


def fused_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` / ``bias`` as they are (no copy, no random initialisation)."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def is_fused(model: nn.Module, group: str = "qkv_proj") -> bool:
    """Whether ``model``'s decoder layers hold the fused linear ``group`` (``qkv_proj`` or ``gate_up_proj``)."""
    parent = next(p for p, name, _ in FUSED_GROUPS if name == group)
    return getattr(getattr(model.model.layers[0], parent), group) is not None


def fuse_projections(model: nn.Module, groups: tuple[str, ...] = FLOAT_GROUPS) -> nn.Module:
    """Fuse the ``groups`` (names of ``FUSED_GROUPS``' fused linears) of every decoder layer of a loaded
    ``CausalLM`` (in place; returns it). A group already fused is left as it is."""
    for parent_name, fused_name, parts in FUSED_GROUPS:
        if fused_name not in groups or is_fused(model, fused_name):
            continue
        for layer in model.model.layers:
            parent = getattr(layer, parent_name)
            weight, bias = concat_linears([getattr(parent, name) for name in parts])
            for name in parts:
                delattr(parent, name)  # frees the separate weights before the next layer allocates
            setattr(parent, fused_name, fused_linear(weight, bias))
    return model
