"""Device-side description of one step's tokens, as the model consumes it.

Token layout invariant: the first ``num_decode`` tokens are the single-token
rows (one per row, attended through the batched paged path), the rest are
multi-token prefill chunks, one row after another. ``slot_mapping[i]`` is the
flat KV index ``block * block_size + offset`` that token ``i`` writes its key and
value to; padding tokens point at the dummy block, which no request owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillRow:
    """A chunk of ``q_len`` tokens that ends at context length ``ctx_len``."""

    token_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] int64


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decode] int64
    prefill_rows: list[PrefillRow]
    logits_indices: torch.Tensor  # [R] int64, tokens whose logits are sampled


@dataclass(slots=True)
class PagedForwardBatch(ForwardBatch):
    """A ``ForwardBatch`` that also carries the prefill rows as device tensors.

    The CUDA executor uploads these from pinned memory with the rest of the
    step, so the Triton prefill kernel needs no host round trip; given a plain
    ``ForwardBatch`` it builds them from ``prefill_rows`` (a blocking copy).
    The torch reference ignores them.
    """

    prefill_meta: torch.Tensor | None = None  # [P, 3] int64: token_start, q_len, ctx_len
    prefill_tables: torch.Tensor | None = None  # [P, >= max blocks of any row] int64
    max_prefill_len: int = 0  # largest q_len among the prefill rows
