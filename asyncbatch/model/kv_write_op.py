"""The KV cache write as an op that compiled graphs keep in place (``compile_decode``).

Traced by ``torch.compile``, ``index_copy_`` into the caches (tensors the compiled function closes over)
is functionalised: the graph builds a new cache and copies it back, every step, so a compiled step's time
grew with the cache (one row of SmolLM2 in float32: 28.4 ms with a 33-block cache, 256.6 ms with 2,049;
eager 31-33 ms; ``profiles/cpu-kernel-threads-intel-xeon-2core/micro/compiled_cache_size.py``). An op that
declares its cache arguments mutated (``Tensor(a!)``) stays one in-place write in the graph. Eager steps
do not go through it (``paged_attention.write_kv`` calls it only while compiling): the dispatcher would add
a few microseconds a layer for nothing.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("asyncbatch", "FRAGMENT")
_LIB.define("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()")


def write_kv_in_place(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Store ``k`` / ``v`` (``[T, kv_heads, head_dim]``) at the caches' flat slots ``slot_mapping`` (``[T]``)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


_LIB.impl("write_kv", write_kv_in_place, "CPU")
_LIB.impl("write_kv", write_kv_in_place, "CUDA")


@torch.library.register_fake("asyncbatch::write_kv")
def _write_kv_fake(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    return None
