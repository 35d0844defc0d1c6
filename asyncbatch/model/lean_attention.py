"""The lean step's decode attention (``lean_cpu.c``'s ``ab_decode_attention``) inside the torch ops' CPU steps.

**Why.** A step the lean step does not take (more decode rows than the model's ``lean_max_rows``, or prefill
chunks beside them) runs the torch ops, whose decode attention gathers every row's pages into one padded tensor
in every layer and then runs ``scaled_dot_product_attention`` over the widest row's length: at 2,048 tokens a row
that copy dominates the step (float32 SmolLM2-135M, 16 rows on a 2-vCPU Zen 4: 861 ms a step against 200 for
the lean step, whose attention reads the cache in place; profiles/lean-products-amd-epyc-zen4-2core/row-limit).
The kernel has no row limit of its own: it splits (row, chunk of 256 positions) items over the threads (a chunk's
KV heads in one pass over its positions), and its work is each row's own context. So the decode rows of those
steps attend with it; the products stay the linears' own (oneDNN or MKL, which take many rows in one pass over the
weights), and prefill chunks keep torch's attention.

**Numerics.** The lean step's (``lean_step``'s module docstring): float32 sums in another order than SDPA's, in
bfloat16 the weighted sum of values taken in float32 where the fused SDPA kernel rounds its probabilities first.

**Where.** The lean step's models and CPUs (``model.lean_kernels`` set: float32 or bfloat16, q/k/v fused, no
Qwen3 q/k norms, the library built), outside ``torch.compile``; the caches in the queries' dtype; at any context,
in float32 and bfloat16 alike (measured below). ``ASYNCBATCH_CPU_LEAN_STEP=0`` keeps torch's attention too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.lean_step import DTYPE_CODES, cache_indices

# Measured on the Zen 4 VM (steps alone, 12 / 16 / 32 rows, the kernel against torch's attention;
# profiles/lean-products-amd-epyc-zen4-2core/attention-past-the-limit and attention-kernel-rows-in-one-pass): float32
# 0.13-0.68x at 512-2,048 tokens a row, 0.91-1.03x at 128; bfloat16 0.49-0.86x at 512-1,024, 0.70-0.90x at 128-256.
# (Until the kernel read a row's KV heads in one pass, bfloat16 steps took it only from 1,024 tokens: torch's
# bfloat16 attention was as fast below.) No threshold: a decode row's attention is then the same kernel whatever
# the step's row count, in the lean step and past it.

# (q [rows, heads, head_dim], k_cache, v_cache, scale) -> [rows, heads, head_dim] in q's dtype
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def decode_attention_kernel(lib, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                            dtype: torch.dtype) -> DecodeAttention | None:
    """The decode rows' attention of one step by the library ``lib`` (every layer's, the same tables), or None
    where it does not apply (no decode rows, tracing, caches not in ``dtype``). Checks the step's block tables
    against the caches once (``lean_step.cache_indices``: the kernel reads them unchecked)."""
    rows = batch.num_decode
    k0, v0 = kv_caches[0]
    if (not rows or torch.compiler.is_compiling() or dtype not in DTYPE_CODES or k0.dtype != dtype
            or v0.dtype != dtype or not (k0.is_contiguous() and v0.is_contiguous())):
        return None
    _, block_size, kv_heads, head_dim = k0.shape
    tables, ctx, _ = cache_indices(batch, k0)
    code, bf, threads = DTYPE_CODES[dtype], int(dtype == torch.bfloat16), torch.get_num_threads()
    tables_p, ctx_p, stride = tables.data_ptr(), ctx.data_ptr(), tables.stride(0)

    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        q = q.contiguous()  # a view of the step's q/k/v product: rows (heads + 2 kv_heads) * head_dim apart
        out = torch.empty_like(q)
        lib.ab_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), code, tables_p, stride, ctx_p,
                                rows, q.shape[1], kv_heads, head_dim, block_size, scale, out.data_ptr(), code, bf,
                                threads)
        return out

    return attend
