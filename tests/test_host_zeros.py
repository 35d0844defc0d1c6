"""The CPU KV cache's memory (``model.host_zeros``): zeros like ``torch.zeros``, aligned, owned, writable;
and a CPU model's caches are built from it, one tensor per layer and side."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model

from asyncbatch.model.host_zeros import host_zeros
from asyncbatch.model.loader import load_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(3, 16, 2, 8), (1,), (4096, 16, 3, 64)])
def test_reads_as_torch_zeros_and_is_aligned(shape, dtype):
    t = host_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))


def test_memory_outlives_the_numpy_array_and_is_private():
    a, b = host_zeros((1 << 20,), torch.float32), host_zeros((1 << 20,), torch.float32)
    a[::4096] = 1.0
    assert float(a.sum()) == 256 and float(b.sum()) == 0  # two allocations, each written independently
    view = a[:8].clone()
    del b
    assert torch.equal(a[:8], view)


def test_cpu_kv_caches_are_separate_zeroed_tensors(tmp_path):
    model = load_model(save_tiny_model(tmp_path / "llama", "LlamaForCausalLM"), torch.float32, "cpu",
                       max_positions=64)
    caches = model.new_kv_caches(num_blocks=5, block_size=4)
    assert len(caches) == len(model.model.layers)
    pointers = {t.data_ptr() for pair in caches for t in pair}
    assert len(pointers) == 2 * len(caches)  # no aliasing: compiled steps write each in place
    for k, v in caches:
        assert k.shape == v.shape == (5, 4, model.num_kv_heads, model.head_dim)
        assert k.dtype == torch.float32 and not k.any() and not v.any()
