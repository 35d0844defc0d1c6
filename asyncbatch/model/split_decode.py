"""Split-context ("flash-decoding") decode attention on tensor cores: the second decode kernel.

``triton_attention``'s decode kernel gives each (row, KV head) one program that
multiplies keys element-wise on CUDA cores. This one differs twice:

* the KV head's group of query heads is one side of a tensor-core product
  (``tl.dot``; the group padded to 16 rows, the least it takes), so a program
  holds ``GROUP_PAD x DIM_PAD`` float32 sums and one tile of scores instead of
  a ``GROUP_PAD x BLOCK_N x DIM_PAD`` product;
* a row's context is dealt out in equal runs of ``BLOCK_N`` tiles to
  ``SPLITS`` programs, whose partial softmaxes ``_decode_merge_kernel``
  combines; with one split the first kernel writes the output itself.

``SPLITS`` is chosen from the batch's shapes alone (``decode_splits``: rows,
KV heads, the block table's width and the GPU's multiprocessors), never from
the context lengths' values, so a captured CUDA graph stays valid.

The engine's default decode kernel since its first GPU timing (H200, Triton
3.6, SmolLM2-135M's shape, bf16; profiles/gpu-check-nvidia-h200-*): 35-41 us
where ``triton_attention``'s kernel took 229 us at 256 rows x 512 cached
tokens (2.5-2.8 TB/s of KV read against 0.44), and 11-13 us against 445 us
at 8 rows x 4,096. ``ASYNCBATCH_DECODE_KERNEL=grouped`` (or
``set_decode_kernel("grouped")``) asks for the other one. Why it was written:
ptxas gives the first kernel 242 registers per thread, two programs per
multiprocessor, each walking its row's context alone.
"""

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from asyncbatch.model.triton_tiles import (
    KernelLaunch,
    check_layout,
    load_tile,
    online_softmax_step,
    paged_strides,
    tile_scores,
    tile_slots,
)

# Programs to aim for per multiprocessor, and the most runs a row's context is cut into.
_PROGRAMS_PER_SM = 8
_MAX_SPLITS = 16


@triton.jit
def _split_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, scale,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_bt, stride_ot, stride_oh, num_heads,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLITS: tl.constexpr, FP32_DOT: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + row)
    # The row's tiles, dealt out in equal runs to its SPLITS programs (a run may be empty).
    run = tl.cdiv(tl.cdiv(ctx, BLOCK_N), SPLITS) * BLOCK_N
    start = split * run
    end = tl.minimum(ctx, start + run)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    head_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + n
        valid = pos < end
        block, within = tile_slots(tables_ptr + row * stride_bt, pos, valid, BLOCK_SIZE)
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = load_tile(k_ptr, block, within, kvh, stride_kb, stride_ks, stride_kh, d, kv_mask)
        v = load_tile(v_ptr, block, within, kvh, stride_vb, stride_vs, stride_vh, d, kv_mask)
        s = tl.where(valid[None, :], tile_scores(q, k, FP32_DOT) * scale, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        # A run's first tile holds at least one valid position, so each row's maximum is finite from then on.
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, FP32_DOT)
    if SPLITS == 1:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]  # context 0: acc is 0, so the row is 0
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:
        # Partials [rows, heads, SPLITS, DIM_PAD] and (m, l) [rows, heads, SPLITS, 2]; an empty run leaves
        # m = -inf, l = 0, acc = 0, which _decode_merge_kernel weighs as nothing.
        part = (row * num_heads + heads) * SPLITS + split  # [GROUP_PAD]
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=head_mask)
        real = g < GROUP
        tl.store(part_ml_ptr + part * 2, m_i, mask=real)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=real)


@triton.jit
def _decode_merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_heads,
                         HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    part = (row * num_heads + head) * SPLITS + s
    real = s < SPLITS
    m = tl.load(part_ml_ptr + part * 2, mask=real, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + part * 2 + 1, mask=real, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=real[:, None] & (d < HEAD_DIM)[None, :],
                  other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # context 0: every run empty, every weight 0
    w = tl.exp(m - m_max)  # [SPLITS_PAD]
    total = tl.sum(l_part * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def keys_per_tile(fp32_dot: bool) -> int:
    """``BLOCK_N``: 64 on tensor cores (on the H200 1.15x faster than 32 at both shapes timed, with the same
    split counts); 32 where the products run in IEEE float32 (float32 models, the CPU interpreter), whose
    sums take twice the registers, and which no GPU has timed."""
    return 32 if fp32_dot else 64


@functools.cache  # one lookup per device, not one per layer
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(rows: int, kv_heads: int, max_tiles: int, multiprocessors: int) -> int:
    """Programs per (row, KV head): a power of two, so that the grid holds about
    ``_PROGRAMS_PER_SM`` programs per multiprocessor, never more than
    ``_MAX_SPLITS`` nor than the ``BLOCK_N`` tiles the widest context
    (``max_tiles``) has: one row of a long context gets many, 256 rows of a
    3-KV-head model on an H200's 132 multiprocessors one or two.
    """
    want = -(-_PROGRAMS_PER_SM * multiprocessors // max(1, rows * kv_heads))
    splits = 1
    while splits * 2 <= min(want, _MAX_SPLITS, max_tiles):
        splits *= 2
    return splits


@functools.cache  # called by every layer of every eager step: choose once per shape
def split_decode_launch(group: int, head_dim: int, block_size: int, splits: int = 1,
                        fp32_dot: bool = False, block_n: int | None = None) -> KernelLaunch:
    """The split decode kernel's launch for a model shape (``group`` query heads per KV head).

    The group's query heads are the rows of a tensor-core product, padded to
    16 (``tl.dot``'s least), so each key is read once per KV head, and a
    program holds ``GROUP_PAD x DIM_PAD`` float32 sums and one ``BLOCK_N``
    tile of scores rather than the grouped kernel's ``GROUP_PAD x BLOCK_N x
    DIM_PAD`` products (167 registers a thread against 242 for SmolLM2's
    shape with Triton 3.6); ``fp32_dot``: IEEE float32 products (float32
    models, and the CPU interpreter); ``block_n`` overrides ``keys_per_tile``.
    """
    group_pad, dim_pad = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(head_dim))
    constexprs = {"GROUP": group, "GROUP_PAD": group_pad, "HEAD_DIM": head_dim, "DIM_PAD": dim_pad,
                  "BLOCK_SIZE": block_size, "BLOCK_N": block_n or keys_per_tile(fp32_dot), "SPLITS": splits,
                  "FP32_DOT": fp32_dot}
    # 8 warps once the float32 sums and a tile's addresses outgrow 4 warps' registers (ptxas for sm_90 spilled
    # float32 products at head_dim 128 with 4: scripts/kernel_resources.py).
    wide = group_pad * dim_pad * (2 if fp32_dot else 1) > 2048
    return KernelLaunch(MappingProxyType(constexprs), num_warps=8 if wide else 4)


def merge_launch(decode: KernelLaunch) -> KernelLaunch:
    """The launch of ``_decode_merge_kernel`` after a ``decode`` launch of several splits: one warp per
    (row, head)."""
    c = decode.constexprs
    return _merge_launch(c["HEAD_DIM"], c["DIM_PAD"], c["SPLITS"])


@functools.cache  # called by every layer of every eager step
def _merge_launch(head_dim: int, dim_pad: int, splits: int) -> KernelLaunch:
    constexprs = {"HEAD_DIM": head_dim, "DIM_PAD": dim_pad, "SPLITS": splits,
                  "SPLITS_PAD": triton.next_power_of_2(splits)}
    return KernelLaunch(MappingProxyType(constexprs), num_warps=1)


def engine_launch(q: torch.Tensor, k_cache: torch.Tensor, table_width: int) -> KernelLaunch:
    """``split_decode_launch`` for a batch's shapes: split as ``decode_splits`` says on a GPU; one program per
    (row, KV head) in the CPU interpreter, which runs programs one after another."""
    rows, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    fp32_dot = q.dtype == torch.float32 or not q.is_cuda
    splits = 1
    if q.is_cuda:
        max_tiles = -(-table_width * block_size // keys_per_tile(fp32_dot))
        splits = decode_splits(rows, kv_heads, max_tiles, _multiprocessors(q.device))
    return split_decode_launch(heads // kv_heads, head_dim, block_size, splits, fp32_dot=fp32_dot)


def split_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, launch: KernelLaunch | None = None) -> torch.Tensor:
    """q ``[B, heads, head_dim]`` → ``[B, heads, head_dim]``; block tables ``[B, any width]``.

    Row ``i`` attends over its first ``context_lens[i]`` cached positions.
    Launch only (no host sync), so it can be captured into a CUDA graph: the
    split count depends on shapes alone (rows, table width), never on the
    context lengths' values. ``launch`` overrides ``engine_launch``'s choice
    (for tuning: ``scripts/attention_bench.py``).
    """
    check_layout(q, k_cache, v_cache)
    b, h = q.shape[0], q.shape[1]
    kvh = k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    launch = launch or engine_launch(q, k_cache, block_tables.shape[1])
    c = launch.constexprs
    splits = c["SPLITS"]
    if splits > 1:
        part_acc = torch.empty(b, h, splits, c["DIM_PAD"], dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not read: the programs write ``out`` themselves
    _split_decode_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml, scale,
        *paged_strides(q, k_cache, v_cache, block_tables, out),
        h, **launch.options(), **c,
    )
    if splits > 1:
        merge = merge_launch(launch)
        _decode_merge_kernel[(b, h)](part_acc, part_ml, out, out.stride(0), out.stride(1), h,
                                     **merge.options(), **merge.constexprs)
    return out


