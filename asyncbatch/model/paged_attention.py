"""Attention over the paged KV cache: the torch reference, and dispatch to Triton on CUDA.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
The torch reference (the CPU path, and CUDA without Triton) attends
single-token rows together with a static-shape gather through their block
tables (padded to ``max_blocks``, masked by context length) and multi-token
chunks one row at a time with a causal mask offset by the tokens already in
the cache.

On CUDA tensors ``paged_attention`` runs the Triton kernels of
``triton_attention`` instead (decode rows and all prefill chunks in one launch
each), unless Triton is missing or ``ASYNCBATCH_ATTENTION=torch`` (or
``set_attention_backend("torch")``) asks for the reference. Triton is imported
on the first CUDA call only, so CPU runs never import it.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import torch.nn.functional as F

from asyncbatch.model.forward_batch import ForwardBatch

ATTENTION_BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("ASYNCBATCH_ATTENTION", "auto")
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
    if device.type != "cuda" or _backend == "torch":
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
    """Store this step's keys/values at their flat slots."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)  # k: [T, kv_heads, head_dim]
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids → [B, max_blocks * block_size, kv_heads, head_dim].

    ``index_select`` on the flattened cache: about twice as fast on CPU as
    advanced indexing with a 2-D index, and the same kernel on CUDA.
    """
    b, mb = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache.index_select(0, block_tables.reshape(-1)).view(b, mb * bs, kvh, d)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, heads, head_dim] → [B, heads, head_dim]; one query per row."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    k = gather_blocks(k_cache, block_tables).transpose(1, 2)  # [B, kv_heads, L, head_dim]
    v = gather_blocks(v_cache, block_tables).transpose(1, 2)
    length = k.shape[2]
    mask = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    qg = q.view(b, kvh, h // kvh, d)  # [B, kv_heads, group, head_dim]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(b, h, d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx_len: int,
                      block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, heads, head_dim] for the last q_len positions of a ctx_len context."""
    q_len, h, _ = q.shape
    kvh = k_cache.shape[2]
    k = gather_blocks(k_cache, block_table[None])[0, :ctx_len]  # [ctx_len, kv_heads, head_dim]
    v = gather_blocks(v_cache, block_table[None])[0, :ctx_len]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
    kh = k.transpose(0, 1).unsqueeze(0).repeat_interleave(h // kvh, dim=1)  # [1, heads, ctx, head_dim]
    vh = v.transpose(0, 1).unsqueeze(0).repeat_interleave(h // kvh, dim=1)
    prior = ctx_len - q_len
    if prior == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        rows = torch.arange(q_len, device=q.device)[:, None] + prior
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows  # [q_len, ctx]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # [q_len, heads, head_dim]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] → [T, heads, head_dim]."""
    write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    kernels = triton_kernels(q.device)
    if kernels is not None:
        return kernels.paged_attention(q, k_cache, v_cache, batch, scale)
    return reference_attention(q, k_cache, v_cache, batch, scale)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                        scale: float) -> torch.Tensor:
    """The torch path of ``paged_attention``, the step's keys/values being in the cache already."""
    nd = batch.num_decode
    if not batch.prefill_rows:
        return decode_attention(q, k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, batch.decode_block_tables,
                                    batch.decode_context_lens, scale)
    for row in batch.prefill_rows:
        sl = slice(row.token_start, row.token_start + row.q_len)
        out[sl] = prefill_attention(q[sl], k_cache, v_cache, row.ctx_len, row.block_table, scale)
    return out
