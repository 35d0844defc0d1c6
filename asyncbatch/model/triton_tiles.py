"""What the Triton attention kernels share: the paged cache's address arithmetic, the tensor-core tile
step of an online softmax, a launch's compile-time choices, and the layout check (``triton_attention``'s
prefill kernel and ``split_decode``'s kernel both use them)."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def tile_slots(table_row_ptr, pos, valid, BLOCK_SIZE: tl.constexpr):
    """(block, offset within it) of each context position ``pos`` of a row, through its block table."""
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block, pos % BLOCK_SIZE


@triton.jit
def load_tile(cache_ptr, block, within, kvh, stride_b, stride_s, stride_h, d, mask):
    """``[BLOCK_N, DIM_PAD]`` of one KV head's cache entries at (block, within); 0 where masked."""
    return tl.load(cache_ptr + (block * stride_b + within * stride_s + kvh * stride_h)[:, None] + d[None, :],
                   mask=mask, other=0.0)


@triton.jit
def tile_scores(q, k, FP32_DOT: tl.constexpr):
    """``q [M, DIM_PAD] @ k [N, DIM_PAD]^T`` on tensor cores (IEEE float32 products where ``FP32_DOT``)."""
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, FP32_DOT: tl.constexpr):
    """Fold one tile into a running softmax: scores ``s [M, N]`` (already scaled, -inf where masked) and
    values ``v [N, DIM_PAD]`` into the row maxima ``m_i``, sums ``l_i`` and weighted values ``acc``.
    Each row's new maximum must be finite (the caller's tile holds a key the row sees, or an earlier one did)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """What one kernel launch compiles: its constexpr arguments, warps per program and software-pipeline
    stages (None: Triton's default) (read-only: cached)."""

    constexprs: Mapping[str, int | bool]
    num_warps: int
    num_stages: int | None = None

    def options(self) -> dict[str, int]:
        """The launch's keyword options for a ``kernel[grid](...)`` call."""
        return {"num_warps": self.num_warps} | ({} if self.num_stages is None else {"num_stages": self.num_stages})


def paged_strides(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  out: torch.Tensor) -> tuple[int, ...]:
    """The strides every attention kernel here takes, in their argument order: ``q``'s token and head, each
    cache's block, slot and KV head, the block table's row, ``out``'s token and head."""
    return (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0),
            out.stride(1))


def check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the KV caches must be contiguous in head_dim")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k_cache.shape[2]} KV heads")
