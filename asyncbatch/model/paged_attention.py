"""Attention over the paged KV cache: the torch reference, and dispatch to Triton on CUDA.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
The torch reference (the CPU path, and CUDA without Triton) attends
single-token rows together with a static-shape gather through their block
tables (padded to ``max_blocks``, masked by context length) and multi-token
chunks one row at a time with a causal mask offset by the tokens already in
the cache. What every layer of a step shares (the flattened block tables, the
masks) is an ``AttentionPlan`` built once per forward by ``plan_attention``.

On CUDA tensors ``paged_attention`` runs the Triton kernels of
``triton_attention`` instead (decode rows and all prefill chunks in one launch
each), unless Triton is missing or ``ASYNCBATCH_ATTENTION=torch`` (or
``set_attention_backend("torch")``) asks for the reference. Triton is imported
on the first CUDA call only, so CPU runs never import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.kv_write_op import write_kv_in_place

ATTENTION_BACKENDS = ("auto", "triton", "torch")
# None until the first CUDA call reads ``ASYNCBATCH_ATTENTION``: an engine core forked from the fork server
# (which imported this module) adopts its caller's environment first (``core_process.adopt_environment``).
_backend: str | None = None
_triton: ModuleType | None = None
_triton_missing = False


def set_attention_backend(name: str) -> None:
    """``"auto"`` (Triton on CUDA when it imports), ``"triton"`` (required on CUDA) or ``"torch"``."""
    global _backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    _backend = name


def triton_kernels(device: torch.device) -> ModuleType | None:
    """The ``triton_attention`` module if attention on ``device`` should use it, else None."""
    global _triton, _triton_missing
    if device.type != "cuda":
        return None
    if _backend is None:
        set_attention_backend(os.environ.get("ASYNCBATCH_ATTENTION", "auto"))
    if _backend == "torch":
        return None
    if _triton is None and not _triton_missing:
        try:
            from asyncbatch.model import triton_attention
        except ImportError:
            if _backend == "triton":
                raise
            _triton_missing = True
        else:
            _triton = triton_attention
    return _triton


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values (``[T, kv_heads, head_dim]``) at their flat slots; in a compiled graph
    through the op that stays in place (``kv_write_op``)."""
    if torch.compiler.is_compiling():
        torch.ops.asyncbatch.write_kv(k_cache, v_cache, k, v, slot_mapping)
    else:
        write_kv_in_place(k_cache, v_cache, k, v, slot_mapping)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """``blocks`` (``rows`` block tables of equal width, flattened) → ``[rows, width * block_size, kv_heads,
    head_dim]``.

    ``index_select`` on the flattened cache: about twice as fast on CPU as
    advanced indexing with a 2-D index, and the same kernel on CUDA.
    """
    kvh, d = cache.shape[2:]
    return cache.index_select(0, blocks).view(rows, -1, kvh, d)


@dataclass(slots=True)
class PrefillPlan:
    """One prefill row as every layer's attention reads it."""

    tokens: slice  # the row's tokens in the step
    blocks: torch.Tensor  # [ceil(ctx_len / block_size)] block ids
    ctx_len: int
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when the chunk starts the context (plain causal)


@dataclass(slots=True)
class AttentionPlan:
    """What the torch reference needs besides the cache, the same in every layer of a step: built once per
    forward (``plan_attention``) instead of once per layer. Static shapes (no host reads of device values),
    so building it inside a captured decode step is allowed."""

    decode_blocks: torch.Tensor  # [B * max_blocks] the decode rows' block tables, flattened
    decode_mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] additive: 0 within the context, -inf beyond
    prefill: list[PrefillPlan]
    # The decode rows' attention in place instead of the gather and SDPA, (q, k_cache, v_cache, scale) -> out: the
    # lean step's kernel on CPUs that have it (``lean_attention``); None: torch's.
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None


def plan_attention(batch: ForwardBatch, block_size: int, device: torch.device,
                   dtype: torch.dtype) -> AttentionPlan | None:
    """The step's ``AttentionPlan``, or None where ``paged_attention`` runs the Triton kernels (they read
    the batch's own tensors)."""
    if triton_kernels(device) is not None:
        return None
    return reference_plan(batch, block_size, device, dtype)


def reference_plan(batch: ForwardBatch, block_size: int, device: torch.device, dtype: torch.dtype) -> AttentionPlan:
    """``plan_attention`` for the torch reference, whatever the device; ``dtype``: the queries'."""
    plan = plan_decode(batch.decode_block_tables, batch.decode_context_lens, block_size, dtype)
    for row in batch.prefill_rows:
        mask = causal_mask(row.q_len, row.ctx_len, device) if row.ctx_len > row.q_len else None
        plan.prefill.append(PrefillPlan(slice(row.token_start, row.token_start + row.q_len), row.block_table,
                                        row.ctx_len, mask))
    return plan


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     plan: AttentionPlan | None = None) -> torch.Tensor:
    """q: [B, heads, head_dim] → [B, heads, head_dim]; one query per row. ``plan`` (its decode part) stands
    for ``block_tables`` and ``context_lens`` when given."""
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    if plan is None:
        plan = plan_decode(block_tables, context_lens, bs, q.dtype)
    # The query heads of one KV head's group attend together: no repeat of the keys per query head.
    k = gather_blocks(k_cache, plan.decode_blocks, b).transpose(1, 2)  # [B, kv_heads, L, head_dim]
    v = gather_blocks(v_cache, plan.decode_blocks, b).transpose(1, 2)
    qg = q.view(b, kvh, h // kvh, d)  # [B, kv_heads, group, head_dim]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.decode_mask, scale=scale)
    return out.reshape(b, h, d)


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                dtype: torch.dtype) -> AttentionPlan:
    """The decode part of an ``AttentionPlan`` alone (callers of ``decode_attention`` without a step's plan).

    The mask is additive (0 / -inf) in the queries' dtype: what ``scaled_dot_product_attention`` turns a
    boolean mask into on every call, so made once here it gives the same output bit for bit (checked in
    float32 and bfloat16, fully masked rows included)."""
    length = block_tables.shape[1] * block_size
    positions = torch.arange(length, device=block_tables.device)
    beyond = positions[None, :] >= context_lens[:, None]  # [B, L]
    mask = torch.zeros(beyond.shape, dtype=dtype, device=beyond.device).masked_fill_(beyond, float("-inf"))
    return AttentionPlan(block_tables.reshape(-1), mask[:, None, None, :], [])  # mask: [B, 1, 1, L]


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx_len: int,
                      block_table: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: [q_len, heads, head_dim] for the last q_len positions of a ctx_len context. ``mask``: the row's
    ``PrefillPlan.mask`` when the step planned it (None: plain causal, or built here)."""
    q_len, h, _ = q.shape
    kvh = k_cache.shape[2]
    k = gather_blocks(k_cache, block_table, 1)[0, :ctx_len]  # [ctx_len, kv_heads, head_dim]
    v = gather_blocks(v_cache, block_table, 1)[0, :ctx_len]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
    kh = k.transpose(0, 1).unsqueeze(0).repeat_interleave(h // kvh, dim=1)  # [1, heads, ctx, head_dim]
    vh = v.transpose(0, 1).unsqueeze(0).repeat_interleave(h // kvh, dim=1)
    if mask is None and ctx_len > q_len:
        mask = causal_mask(q_len, ctx_len, q.device)
    if mask is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # [q_len, heads, head_dim]


def causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """``[q_len, ctx_len]`` bool: query ``i`` (position ``ctx_len - q_len + i``) sees positions up to its own."""
    queries = torch.arange(q_len, device=device)[:, None] + (ctx_len - q_len)
    return torch.arange(ctx_len, device=device)[None, :] <= queries


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                    plan: AttentionPlan | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] → [T, heads, head_dim]. ``plan``: the step's
    ``plan_attention`` (None: Triton, or built here)."""
    write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    kernels = triton_kernels(q.device)
    if kernels is not None:
        return kernels.paged_attention(q, k_cache, v_cache, batch, scale)
    return reference_attention(q, k_cache, v_cache, batch, scale, plan)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                        scale: float, plan: AttentionPlan | None = None) -> torch.Tensor:
    """The torch path of ``paged_attention``, the step's keys/values being in the cache already."""
    if plan is None:
        plan = reference_plan(batch, k_cache.shape[1], q.device, q.dtype)
    nd = batch.num_decode
    kernel = plan.decode if plan.decode is not None and q.dtype == k_cache.dtype else None

    def attend_decode(qd: torch.Tensor) -> torch.Tensor:
        if kernel is not None:
            return kernel(qd, k_cache, v_cache, scale)
        return decode_attention(qd, k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale,
                                plan)

    if not plan.prefill:
        return attend_decode(q)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = attend_decode(q[:nd])
    for row in plan.prefill:
        out[row.tokens] = prefill_attention(q[row.tokens], k_cache, v_cache, row.ctx_len, row.blocks, scale, row.mask)
    return out
