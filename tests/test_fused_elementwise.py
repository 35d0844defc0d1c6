"""``fused_elementwise``'s kernels against the torch ops they replace, and a whole model with them.

Without a GPU the kernels run in Triton's CPU interpreter (``conftest`` selects it before anything imports
Triton), in float32 only: the interpreter computes bfloat16 arithmetic wrongly. On a GPU (``gpu_check.sh``)
bfloat16 runs too, within a rounding step of the torch ops (the norm's sum is taken in another order).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

_CUDA = torch.cuda.is_available()
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
pytestmark = pytest.mark.skipif(not _CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton was imported without its interpreter and there is no GPU")

from tiny_models import save_tiny_model

from asyncbatch.model import fused_elementwise as fused
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.llama import RMSNorm
from asyncbatch.model.loader import load_model
from asyncbatch.model.rope import RopeTables, apply_rope

DEVICE = torch.device("cuda" if _CUDA else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if _CUDA else [])
# float32: the reference's own arithmetic up to the norm's order of summation; bfloat16: one rounding step.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.double().abs().max().clamp_min(1.0)
    return ((got.double() - want.double()).abs().max() / scale).item() <= TOLERANCE[want.dtype]


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 100], ids=["pow2", "smollm2", "padded"])
def test_add_rms_norm_is_the_residual_sum_and_the_norm(dtype, hidden):
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, dtype=dtype, seed=1, scale=0.5) + 1)
    x, residual = randn(7, hidden, dtype=dtype, seed=2), randn(7, hidden, dtype=dtype, seed=3, scale=4.0)
    out, total = fused.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(total, x + residual)  # one rounding of an exact float32 sum: the same bits
    assert close(out, norm(x + residual))
    out, same = fused.add_rms_norm(x, None, norm.weight, norm.eps)
    assert same is x and close(out, norm(x))
    empty, _ = fused.add_rms_norm(x[:0], residual[:0], norm.weight, norm.eps)
    assert empty.shape == (0, hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 24], ids=["16", "64", "padded"])
def test_rope_rotates_strided_heads_like_apply_rope(dtype, head_dim):
    heads, kv_heads, tokens = 4, 2, 5
    qkv = randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, seed=4)
    qk = qkv.split((heads + kv_heads, kv_heads), dim=1)[0]  # the engine's view: rows strided by the v heads
    assert not qk.is_contiguous()
    tables = RopeTables(randn(tokens, 1, head_dim, dtype=dtype, seed=5), randn(tokens, 1, head_dim, dtype=dtype,
                                                                                 seed=6))
    got = fused.rope(qk, tables.cos, tables.sin)
    assert got.is_contiguous() and close(got, apply_rope(qk, tables))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fused_product", [True, False], ids=["gate-up-views", "two-tensors"])
def test_silu_mul_is_silu_of_gate_times_up(dtype, fused_product):
    n = 1536 + 40  # more than one program's columns, and a ragged last one
    if fused_product:
        gate, up = randn(3, 2 * n, dtype=dtype, seed=7, scale=3.0).chunk(2, dim=-1)
    else:
        gate, up = randn(3, n, dtype=dtype, seed=7, scale=3.0), randn(3, n, dtype=dtype, seed=8)
    assert close(fused.silu_mul(gate, up), F.silu(gate) * up)


def test_a_row_the_kernels_cannot_step_through_is_refused():
    x = randn(4, 8, dtype=torch.float32, seed=9).t()
    with pytest.raises(ValueError, match="x must have a contiguous last dimension"):
        fused.add_rms_norm(x, None, torch.ones(4, device=DEVICE), 1e-5)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_a_model_with_the_fused_kernels_gives_its_logits(tmp_path, arch):
    """Two prefill chunks through every layer, the reference ops vs ``enable``'s kernels and fused gate/up
    product: float32 logits within the norm's reordering (Qwen3: q/k norms before the fused rotary)."""
    path = save_tiny_model(tmp_path / "model", arch)
    model = load_model(path, torch.float32, DEVICE, max_positions=64)
    block_size, num_blocks = 4, 16
    caches = model.new_kv_caches(num_blocks, block_size)
    prompts = [list(range(3, 12)), list(range(20, 26))]
    tokens = [t for p in prompts for t in p]
    starts = [0, len(prompts[0])]
    tables = [torch.arange(1, 4, device=DEVICE), torch.arange(5, 7, device=DEVICE)]
    slots = [int(tables[r][i // block_size]) * block_size + i % block_size
             for r, p in enumerate(prompts) for i in range(len(p))]
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens, device=DEVICE), positions=torch.tensor(
            [i for p in prompts for i in range(len(p))], device=DEVICE),
        slot_mapping=torch.tensor(slots, device=DEVICE), num_decode=0,
        decode_block_tables=torch.zeros(0, 4, dtype=torch.int64, device=DEVICE),
        decode_context_lens=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        prefill_rows=[PrefillRow(s, len(p), len(p), tables[r]) for r, (s, p) in enumerate(zip(starts, prompts))],
        logits_indices=torch.tensor([s + len(p) - 1 for s, p in zip(starts, prompts)], device=DEVICE))
    with torch.no_grad():
        want = model(batch, caches)
        fused.enable(model)
        assert model.model.layers[0].mlp.gate_up_proj is not None and model.fused_elementwise is fused
        got = model(batch, [(k.clone(), v.clone()) for k, v in caches])
    assert got.shape == want.shape == (2, model.config.vocab_size)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
