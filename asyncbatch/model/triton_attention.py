"""Triton kernels for attention over the paged KV cache, and the dispatch helper.

Two kernels, both reading keys/values through block tables, with an online
softmax in float32 (the cache layout is ``paged_attention``'s:
``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer):

* ``decode_attention``: one query token per row. One program per (row, KV
  head) computes every query head of that KV head's group, so each key is
  read once. The loop runs over ``ceil(context_len / BLOCK_N)`` tiles of *that
  row only*, so a block table may be as wide as ``max_blocks_per_seq`` (the
  static shape a CUDA graph captures) without costing anything: entries past
  a row's context are never read. A row with context length 0 writes zeros.
  (``split_decode`` holds the engine's default decode kernel, tensor-core
  products over a context split among programs, 5.6-34x faster than this one
  on an H200; ``set_decode_kernel`` or ``ASYNCBATCH_DECODE_KERNEL`` chooses
  which one the engine launches.)
* ``prefill_attention``: many chunks of consecutive query tokens in one
  launch (varlen). Row ``r`` is described by ``rows[r] = (token_start, q_len,
  ctx_len)``: its queries are tokens ``token_start .. token_start + q_len`` of
  ``q`` and sit at positions ``ctx_len - q_len .. ctx_len - 1`` of the row's
  context, with a causal mask. Grid ``(rows, q tiles, heads)``; tiles past a
  row's ``q_len`` do nothing.

Numerics: scores and the softmax are float32. With float32 inputs the dot
products run in IEEE float32 (not tf32), so results match the torch reference
to about 1e-7 relative; with bfloat16/float16 inputs the matrix products of
the prefill kernel take the inputs' dtype on tensor cores, accumulating in
float32.

Triton is imported with this module, and its interpreter (CPU tensors,
``TRITON_INTERPRET=1``) is chosen when ``triton`` is first imported, so
``paged_attention`` imports this module only when a CUDA tensor arrives. On
CPU tensors the kernels need the interpreter; there every product runs in
float32 because the interpreter computes bfloat16 arithmetic wrongly.
"""

import functools
import os
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from asyncbatch.model import split_decode
from asyncbatch.model.forward_batch import ForwardBatch, PagedForwardBatch
from asyncbatch.model.triton_tiles import (
    KernelLaunch,
    check_layout,
    load_tile,
    online_softmax_step,
    paged_strides,
    tile_scores,
    tile_slots,
)

# Registers per program stay bounded: a decode tile holds GROUP_PAD * BLOCK_N * DIM_PAD floats.
_DECODE_TILE_ELEMENTS = 8192

# The engine's decode kernel: "split" (``split_decode``) or "grouped" (``decode_attention``, below). Split is
# the default: on an H200 it took 35-41 us where grouped took 229 us (256 rows x 512 cached tokens of
# SmolLM2-135M's shape) and 11-13 us against 445 us (8 rows x 4,096); profiles/gpu-check-nvidia-h200-*.
DECODE_KERNELS = ("grouped", "split")


def _checked_decode_kernel(name: str, source: str) -> str:
    if name not in DECODE_KERNELS:
        raise ValueError(f"{source} must be one of {DECODE_KERNELS}, got {name!r}")
    return name


_decode_kernel_choice = _checked_decode_kernel(os.environ.get("ASYNCBATCH_DECODE_KERNEL", "split"),
                                               "ASYNCBATCH_DECODE_KERNEL")


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_bt, stride_ot, stride_oh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    head_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_mask, other=0.0)
    q = q.to(tl.float32)  # [GROUP_PAD, DIM_PAD]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, ctx, BLOCK_N):
        pos = start + n
        valid = pos < ctx
        block, within = tile_slots(tables_ptr + row * stride_bt, pos, valid, BLOCK_SIZE)
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = load_tile(k_ptr, block, within, kvh, stride_kb, stride_ks, stride_kh, d, kv_mask).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # The first tile always holds position 0, so m_new is finite from the first iteration on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_tile(v_ptr, block, within, kvh, stride_vb, stride_vs, stride_vh, d, kv_mask).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]  # context 0: acc is 0, so the row is 0
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_mask)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, rows_ptr, out_ptr, scale,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    r = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    token_start = tl.load(rows_ptr + r * 3)
    q_len = tl.load(rows_ptr + r * 3 + 1)
    ctx = tl.load(rows_ptr + r * 3 + 2)
    m0 = tile * BLOCK_M
    if m0 < q_len:
        kvh = head // GROUP
        m = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, DIM_PAD)
        q_mask = (m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        tokens = (token_start + m).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        q_pos = ctx - q_len + m  # [BLOCK_M] position of each query in the row's context
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        kv_end = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)  # causal: later keys are masked for the whole tile
        n = tl.arange(0, BLOCK_N)
        for start in range(0, kv_end, BLOCK_N):
            pos = start + n
            valid = pos < kv_end
            block, within = tile_slots(tables_ptr + r * stride_bt, pos, valid, BLOCK_SIZE)
            kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
            k = load_tile(k_ptr, block, within, kvh, stride_kb, stride_ks, stride_kh, d, kv_mask)
            v = load_tile(v_ptr, block, within, kvh, stride_vb, stride_vs, stride_vh, d, kv_mask)
            keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(keep, tile_scores(q, k, FP32_DOT) * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
            # Key 0 is visible to every query and lies in the first tile: each row's maximum is finite from then on.
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, FP32_DOT)
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)


@functools.cache  # called by every layer of every eager step: choose once per shape
def decode_launch(group: int, head_dim: int, block_size: int) -> KernelLaunch:
    """The decode kernel's tile for a model shape (``group`` query heads per KV head).

    ``BLOCK_N`` is the largest power of two in [16, 64] whose tile
    ``GROUP_PAD x BLOCK_N x DIM_PAD`` stays within ``_DECODE_TILE_ELEMENTS``;
    a tile above that (large groups) gets 8 warps, so each thread still holds
    at most 64 of its elements (ptxas for sm_90 keeps that in registers).
    """
    group_pad, dim_pad = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    fit = max(1, _DECODE_TILE_ELEMENTS // (group_pad * dim_pad))
    block_n = max(16, min(64, 1 << (fit.bit_length() - 1)))
    tile = group_pad * block_n * dim_pad
    constexprs = {"GROUP": group, "GROUP_PAD": group_pad, "HEAD_DIM": head_dim, "DIM_PAD": dim_pad,
                  "BLOCK_SIZE": block_size, "BLOCK_N": block_n}
    return KernelLaunch(MappingProxyType(constexprs), num_warps=4 if tile <= _DECODE_TILE_ELEMENTS else 8)


def prefill_launch(group: int, head_dim: int, block_size: int, max_q_len: int, fp32_dot: bool) -> KernelLaunch:
    """The prefill kernel's tiles and warps for a model shape and the step's longest chunk."""
    return _prefill_launch(group, head_dim, block_size, max_q_len <= 16, fp32_dot)


@functools.cache  # called by every layer of every eager step; depends on the chunk length only through `short`
def _prefill_launch(group: int, head_dim: int, block_size: int, short: bool, fp32_dot: bool) -> KernelLaunch:
    """See ``prefill_launch``.

    16 query rows for short chunks, else 64 (tensor-core dtypes) or 32
    (``fp32_dot``: IEEE float32 products on CUDA cores, and the CPU
    interpreter); 4 warps up to head_dim 64 on tensor cores, else 8 (head_dim
    128, every float32 tile), so that ptxas for sm_90 keeps the tile in
    registers (``scripts/kernel_resources.py`` shows the table). The 64-row
    tile at head_dim 64 spilled 16 bytes a thread with 4 warps under Triton
    3.9, yet was 1.3x faster than 8 warps on an H200 under Triton 3.6 in two
    runs (4 chunks x 512 tokens after 512 cached: 45.4-45.7 us against
    59.4-60.0; profiles/gpu-check-nvidia-h200-*).
    """
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    if fp32_dot:
        block_m, block_n = (16, 32) if short else (32, 16)
        num_warps = 8
    else:
        block_m, block_n = 16 if short else 64, 64 if dim_pad <= 64 else 32
        num_warps = 4 if dim_pad <= 64 else 8
    constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "DIM_PAD": dim_pad, "BLOCK_SIZE": block_size,
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "FP32_DOT": fp32_dot}
    return KernelLaunch(MappingProxyType(constexprs), num_warps=num_warps)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     launch: KernelLaunch | None = None) -> torch.Tensor:
    """q ``[B, heads, head_dim]`` → ``[B, heads, head_dim]``; block tables ``[B, any width]``.

    Row ``i`` attends over its first ``context_lens[i]`` cached positions.
    Launch only (no host sync), so it can be captured into a CUDA graph.
    ``launch`` overrides ``decode_launch``'s choice (for tuning: ``scripts/attention_bench.py``).
    """
    check_layout(q, k_cache, v_cache)
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    group = h // kvh
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    launch = launch or decode_launch(group, d, k_cache.shape[1])
    _decode_kernel[(b, kvh)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        *paged_strides(q, k_cache, v_cache, block_tables, out),
        **launch.options(), **launch.constexprs,
    )
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      rows: torch.Tensor, max_q_len: int, scale: float, out: torch.Tensor,
                      launch: KernelLaunch | None = None) -> torch.Tensor:
    """Attend every prefill row at once; writes the rows' tokens of ``out`` ``[T, heads, head_dim]``.

    ``rows`` ``[P, 3]`` int64 ``(token_start, q_len, ctx_len)``, ``block_tables``
    ``[P, >= ceil(ctx_len / block_size)]``; ``max_q_len`` bounds the grid.
    Tokens of ``out`` outside the rows are left as they are. ``launch`` overrides
    ``prefill_launch``'s choice.
    """
    check_layout(q, k_cache, v_cache)
    num_rows = rows.shape[0]
    if num_rows == 0 or max_q_len == 0:
        return out
    h, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[2]
    launch = launch or prefill_launch(h // kvh, d, k_cache.shape[1], max_q_len,
                                      fp32_dot=q.dtype == torch.float32 or not q.is_cuda)
    grid = (num_rows, triton.cdiv(max_q_len, launch.constexprs["BLOCK_M"]), h)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, rows, out, scale,
        *paged_strides(q, k_cache, v_cache, block_tables, out),
        **launch.options(), **launch.constexprs,
    )
    return out


def _prefill_inputs(batch: ForwardBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows, tables and longest q_len: from a ``PagedForwardBatch`` as uploaded, else built here (blocking)."""
    if isinstance(batch, PagedForwardBatch) and batch.prefill_meta is not None:
        return batch.prefill_meta, batch.prefill_tables, batch.max_prefill_len
    rows = torch.tensor([(r.token_start, r.q_len, r.ctx_len) for r in batch.prefill_rows], dtype=torch.int64,
                        device=device)
    tables = torch.nn.utils.rnn.pad_sequence([r.block_table for r in batch.prefill_rows], batch_first=True)
    return rows, tables, max(r.q_len for r in batch.prefill_rows)


def set_decode_kernel(name: str) -> None:
    """The decode kernel ``paged_attention`` launches from now on: one of ``DECODE_KERNELS``
    (``ASYNCBATCH_DECODE_KERNEL`` sets it at import; an engine-core process inherits the variable)."""
    global _decode_kernel_choice
    _decode_kernel_choice = _checked_decode_kernel(name, "decode kernel")


def decode_kernel() -> str:
    """The decode kernel ``paged_attention`` launches now (``DECODE_KERNELS``)."""
    return _decode_kernel_choice


def engine_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Decode attention with the kernel ``set_decode_kernel`` chose."""
    if _decode_kernel_choice == "split":
        return split_decode.split_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=out)
    return decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=out)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                    scale: float) -> torch.Tensor:
    """Decode rows then prefill rows of ``batch``; this step's keys/values are already in the cache."""
    nd = batch.num_decode
    out = torch.empty_like(q)  # [T, heads, head_dim]
    if nd:
        engine_decode(q[:nd], k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale,
                      out=out[:nd])
    if batch.prefill_rows:
        rows, tables, max_q_len = _prefill_inputs(batch, q.device)
        prefill_attention(q, k_cache, v_cache, tables, rows, max_q_len, scale, out)
    return out
