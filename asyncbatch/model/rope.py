"""Rotary position embedding tables, computed the way transformers computes them."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PretrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def rope_cos_sin(config: PretrainedConfig, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` in float32.

    Positions are static per type (no dynamic NTK rescaling), so one table
    serves every step and every CUDA graph replay.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == swap_halves(x) * signed_sin(sin)``
    exactly (a negation is exact), so the rotation needs no ``neg`` and no ``cat`` per call."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class RopeTables(NamedTuple):
    """One step's rows of the tables in the activations' dtype, ``[T, 1, head_dim]``: gathered once per
    forward and broadcast over the heads of every layer."""

    cos: torch.Tensor
    sin: torch.Tensor  # ``signed_sin``'s sign folded in


def step_tables(cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> RopeTables:
    """``RopeTables`` of ``positions`` from the float32 ``[P, head_dim]`` tables (cast as transformers casts
    them: after the gather, to the activations' dtype)."""
    return RopeTables(cos[positions].to(dtype)[:, None, :], sin_signed[positions].to(dtype)[:, None, :])


def apply_rope(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """x: [T, heads, head_dim], any heads (q and k together) → a new rotated tensor.

    transformers' ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``: here the
    halves are swapped by one ``roll`` and the sign sits in the table, the same products and sum."""
    return x * tables.cos + x.roll(x.shape[-1] // 2, dims=-1) * tables.sin
