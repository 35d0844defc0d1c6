"""The lean CPU decode step (``model/lean_step.py``, ``lean_cpu.c``): each kernel against the torch ops it replaces,
the whole step against the torch ops' step on tiny models of every architecture it serves, the steps it leaves
to torch, its op count, and a machine without a C compiler.

Compared against the torch path (itself checked against transformers elsewhere, and the golden and
transformers-``generate`` tests run the lean step wherever it builds): bit for bit where the kernel rounds as the
ops do and sums in the same order (the residual sum, rotary, the cache writes, the bfloat16 norm and SiLU of these
inputs), within float32 rounding where a sum's order differs (the norm's variance, the attention), and within one
bfloat16 step of the output's magnitude in bfloat16 attention (torch's fused kernel rounds its probabilities to
bfloat16 before the weighted sum; the kernel keeps them in float32).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from tiny_models import save_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode  # private-name: the op counter's base class

from asyncbatch.model import lean_attention, lean_kernels, lean_step, packed_linears
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.loader import load_model
from asyncbatch.model.packed_linears import F32_PACKED_ENV
from asyncbatch.model.paged_attention import decode_attention
from asyncbatch.model.rope import RopeTables, apply_rope

CPU = torch.device("cpu")
BLOCK = 4
CODES = {torch.float32: 0, torch.bfloat16: 1}
PRODUCT_OPS = {"_linear_pointwise", "linear", "mm", "addmm", "matmul", "linear_dynamic_fp16"}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@pytest.fixture(scope="module")
def lib():
    built = lean_kernels.library()
    if built is None:
        if os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"):
            pytest.fail("a C compiler is here, yet the lean kernels did not build or failed their own checks")
        pytest.skip("no C compiler here: the lean CPU step's kernels cannot be built (the model keeps torch's ops)")
    return built


def _norm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``llama.RMSNorm``'s arithmetic: float32 in one op; bfloat16 normalised, rounded, then times the weight."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, w.shape, w, 1e-5)
    return w * torch.rms_norm(x.float(), w.shape, None, 1e-5).to(x.dtype)


@DTYPES
def test_norm_and_residual_kernels_give_the_torch_ops_values(lib, dtype):
    gen = torch.Generator().manual_seed(0)
    bf = CODES[dtype]
    for rows, n in ((1, 576), (2, 64), (3, 100)):
        x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
        w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
        y = torch.randn(rows, n, generator=gen)  # a product's float32 output, unrounded
        out = torch.empty(rows, n)
        lib.ab_rms_norm(x.data_ptr(), bf, rows, n, w.data_ptr(), bf, 1e-5, bf, out.data_ptr(), 0)
        torch.testing.assert_close(out, _norm_ref(x, w).float(), rtol=2e-6, atol=2e-6)
        stream = x.clone()
        lib.ab_add_rms_norm(y.data_ptr(), 0, stream.data_ptr(), bf, rows, n, w.data_ptr(), bf, 1e-5, bf,
                            out.data_ptr(), 0)
        summed = x + y.to(dtype)  # the product's output rounded to the model's dtype, then torch's add
        assert torch.equal(stream, summed)
        torch.testing.assert_close(out, _norm_ref(summed, w).float(), rtol=2e-6, atol=2e-6)
        if dtype == torch.bfloat16:  # same inputs, same float32 arithmetic, one rounding: the same bits here
            assert torch.equal(out, _norm_ref(summed, w).float())
        before = stream.clone()
        lib.ab_add_rms_norm(y.data_ptr(), 0, stream.data_ptr(), bf, rows, n, None, 0, 0.0, bf, out.data_ptr(), 0)
        assert torch.equal(stream, before + y.to(dtype))  # no weight: the residual sum alone


@DTYPES
def test_rotary_and_cache_write_kernel_gives_the_torch_ops_bits(lib, dtype):
    gen = torch.Generator().manual_seed(1)
    t, heads, kv_heads, d = 3, 6, 2, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen)  # float32, as fbgemm's product returns it
    cos, sin = torch.randn(t, d, generator=gen).to(dtype), torch.randn(t, d, generator=gen).to(dtype)
    k_cache, v_cache = torch.zeros(6, BLOCK, kv_heads, d, dtype=dtype), torch.zeros(6, BLOCK, kv_heads, d, dtype=dtype)
    slots = torch.tensor([5, 17, 2])
    q = torch.empty(t, heads, d, dtype=dtype)
    lib.ab_qkv_rope_write(qkv.data_ptr(), 0, t, heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                          v_cache.data_ptr(), slots.data_ptr(), q.data_ptr(), CODES[dtype], CODES[dtype])
    qk, v = qkv.to(dtype).view(t, heads + 2 * kv_heads, d).split((heads + kv_heads, kv_heads), dim=1)
    rotated = apply_rope(qk, RopeTables(cos[:, None, :], sin[:, None, :]))
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(k_cache.view(-1, kv_heads, d)[slots], rotated[:, heads:])
    assert torch.equal(v_cache.view(-1, kv_heads, d)[slots], v)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, kv_heads, d)[untouched].any()  # nothing written but the tokens' slots


@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [16, 64, 40])
def test_decode_attention_kernel_gives_torchs_attention(lib, dtype, head_dim, threads):
    """Rows of different lengths over scattered blocks, a partial last block, a row table wider than its
    context; head dims the kernel takes as whole vectors (16, 64) and not (40); on one thread and two, three
    rows and one."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads = 6, 2
    k_cache = torch.randn(20, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(20, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    all_tables = torch.tensor([[3, 5, 7, 1, 9], [2, 4, 6, 8, 10], [19, 11, 12, 13, 14]])
    all_ctx = torch.tensor([13, 4, 20])
    all_q = torch.randn(3, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    for b in (3, 1):
        tables, ctx, q = all_tables[:b].contiguous(), all_ctx[:b].contiguous(), all_q[:b].contiguous()
        out = torch.empty(b, heads * head_dim)
        lib.ab_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CODES[dtype],
                                tables.data_ptr(), tables.stride(0), ctx.data_ptr(), b, heads, kv_heads, head_dim,
                                BLOCK, scale, out.data_ptr(), 0, CODES[dtype], threads)
        want = decode_attention(q, k_cache, v_cache, tables, ctx, scale).reshape(b, -1).float()
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(out, out.to(dtype).float())  # rounded to bfloat16, as torch's output is
            torch.testing.assert_close(out, want, rtol=0, atol=2 ** -7 * want.abs().max().item())


@DTYPES
def test_decode_attention_kernel_cuts_long_rows_into_chunks_whose_merge_depends_on_nothing_else(lib, dtype):
    """Rows past the kernel's 256-position chunk (its work items: a row's chunks merged in order): torch's attention
    within the same bounds as short rows, and a row's output bit for bit the same alone or beside other rows, on one
    thread or two (docs/reproducibility.md); a row without context gives zeros."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, blocks = 6, 2, 64, 400
    k_cache = torch.randn(blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor([700, 256, 513])  # three chunks (the last partial), exactly one, one past two
    width = (int(ctx.max()) + BLOCK - 1) // BLOCK
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in range(3)])
    q = torch.randn(3, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    def attend(rows: list[int], threads: int) -> torch.Tensor:
        t, c, x = tables[rows].contiguous(), ctx[rows].contiguous(), q[rows].contiguous()
        out = torch.empty(len(rows), heads * head_dim)
        lib.ab_decode_attention(x.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CODES[dtype], t.data_ptr(),
                                t.stride(0), c.data_ptr(), len(rows), heads, kv_heads, head_dim, BLOCK, scale,
                                out.data_ptr(), 0, CODES[dtype], threads)
        return out

    together = attend([0, 1, 2], 2)
    want = decode_attention(q, k_cache, v_cache, tables, ctx, scale).reshape(3, -1).float()
    if dtype == torch.float32:
        torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(together, want, rtol=0, atol=2 ** -7 * want.abs().max().item())
    for row in range(3):
        for threads in (1, 2):
            assert torch.equal(attend([row], threads), together[row:row + 1])
    assert torch.equal(attend([0, 1, 2], 1), together)
    ctx[1] = 0  # a row without context: zeros, beside rows with
    empty = attend([0, 1], 2)
    assert not empty[1].any() and torch.equal(empty[0], together[0])


@DTYPES
def test_silu_mul_kernel_gives_the_torch_ops_values(lib, dtype):
    gen = torch.Generator().manual_seed(3)
    rows, inter = 2, 200
    fused = torch.randn(rows, 2 * inter, generator=gen) * 4  # gate | up, float32 (fbgemm's output)
    out = torch.empty(rows, inter)
    lib.ab_silu_mul(fused.data_ptr(), fused.data_ptr() + inter * 4, 0, 2 * inter, rows, inter, CODES[dtype],
                    out.data_ptr(), 0)
    gate, up = fused.to(dtype).chunk(2, dim=-1)
    want = (F.silu(gate) * up).float()
    if dtype == torch.bfloat16:
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out, want, rtol=2e-7, atol=1e-7)  # libm's expf against torch's vectorised exp



@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 5, 7])
@DTYPES
def test_product_kernel_gives_the_float32_product(lib, dtype, rows, threads):
    """``ab_gemv`` against ``F.linear`` in float64 of the same values: weight rows split over threads (N = 70,
    not a multiple of 16, and 40 under the threading threshold), a K with a tail past the vectors (100), five
    and seven rows (one pass over each weight row, two), a bias of either dtype; float32 sums, one rounding
    apart. With bfloat16 weights the rows hold bfloat16 values, as the lean step's do (AVX512-BF16 CPUs multiply
    them as bfloat16)."""
    gen = torch.Generator().manual_seed(10)
    for n, with_bias in ((70, True), (40, False)):
        k = 100
        x = torch.randn(rows, k, generator=gen).to(dtype).float()
        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        out = torch.full((rows, n), float("nan"))
        lib.ab_gemv(x.data_ptr(), rows, k, w.data_ptr(), CODES[dtype], None if b is None else b.data_ptr(),
                    CODES[dtype], n, out.data_ptr(), threads)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


ARCHS = {"llama": ("LlamaForCausalLM", {"tie_word_embeddings": True}), "mistral": ("MistralForCausalLM", {}),
         "qwen2-biases": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
         "qwen3": ("Qwen3ForCausalLM", {})}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean-cpu")
    return {name: save_tiny_model(root / name, arch, with_tokenizer=False, seed=4, head_dim=64,
                                  num_attention_heads=3, num_key_value_heads=1, hidden_size=96, **kwargs)
            for name, (arch, kwargs) in ARCHS.items()}


def _decode_batch(rows: int, context: int, gen: torch.Generator) -> ForwardBatch:
    width = -(-context // BLOCK) + 1  # a table wider than the context, as the engine's padded ones are
    tables = 1 + torch.randperm(rows * width, generator=gen).view(rows, width)  # scattered blocks
    lens = torch.tensor([context - r for r in range(rows)])
    pos = lens - 1
    return ForwardBatch(torch.randint(3, 250, (rows,), generator=gen), pos,
                        tables[torch.arange(rows), pos // BLOCK] * BLOCK + pos % BLOCK, rows, tables, lens, [],
                        torch.arange(rows))


def _filled_caches(model, gen: torch.Generator, blocks: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = model.new_kv_caches(blocks, BLOCK)
    for k, v in caches:  # earlier tokens' keys and values, of the magnitude the model writes
        k.copy_(torch.randn(k.shape, generator=gen) * 2)
        v.copy_(torch.randn(v.shape, generator=gen))
    return caches


def _both_ways(model, batch: ForwardBatch, caches) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """(torch ops' logits, lean logits, torch's caches after, lean caches after) from the same caches."""
    kernels = model.lean_kernels
    out = []
    for lean in (False, True):
        model.lean_kernels = kernels if lean else None
        kv = [(k.clone(), v.clone()) for k, v in caches]
        with torch.inference_mode():
            out.append((model(batch, kv), kv))
    model.lean_kernels = kernels
    return out[0][0], out[1][0], out[0][1], out[1][1]


@pytest.mark.parametrize("packed", ["0", "1"], ids=["mkl-separate-gate-up", "packed-fused-gate-up"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2-biases"])
def test_a_float32_lean_step_gives_the_torch_ops_logits(lib, tiny_dirs, name, packed, monkeypatch):
    monkeypatch.setenv(F32_PACKED_ENV, packed)
    model = load_model(tiny_dirs[name], torch.float32, CPU, max_positions=64)
    assert model.lean_kernels is not None
    gen = torch.Generator().manual_seed(5)
    caches = _filled_caches(model, gen)
    for rows in (1, 2):
        batch = _decode_batch(rows, 30, gen)
        want, got, kv_want, kv_got = _both_ways(model, batch, caches)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (kw, vw), (kg, vg) in zip(kv_want, kv_got):  # the step's keys and values land where torch's do
            torch.testing.assert_close(kg, kw, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vg, vw, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_lean_step_stays_within_bfloat16_rounding_of_the_torch_ops(lib, tiny_dirs, monkeypatch):
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    model = load_model(tiny_dirs["llama"], torch.bfloat16, CPU, max_positions=64)
    ref = load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=64)
    gen = torch.Generator().manual_seed(6)
    caches = _filled_caches(model, gen)
    batch = _decode_batch(2, 30, gen)
    want, got, _, _ = _both_ways(model, batch, caches)
    with torch.inference_mode():
        exact = ref(batch, [(k.float(), v.float()) for k, v in caches])
    # No farther from the float32 model than bfloat16's own torch ops are, give or take bfloat16 noise.
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + 0.05
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@DTYPES
def test_a_rows_logits_in_a_lean_step_do_not_depend_on_the_other_rows(lib, tiny_dirs, monkeypatch, dtype):
    """No sum in the lean step's kernels crosses rows or threads (docs/reproducibility.md): a row's logits alone
    and beside ``model.lean_max_rows - 1`` others (the most a lean step takes on this CPU) are the same bits."""
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    model = load_model(tiny_dirs["qwen2-biases"], dtype, CPU, max_positions=64)
    gen = torch.Generator().manual_seed(12)
    rows = model.lean_max_rows
    caches = _filled_caches(model, gen, blocks=1 + rows * 6)
    full = _decode_batch(rows, 20, gen)  # 6 blocks a row (20 tokens of context, a spare block)
    alone = ForwardBatch(full.input_ids[:1], full.positions[:1], full.slot_mapping[:1], 1,
                         full.decode_block_tables[:1], full.decode_context_lens[:1], [], torch.arange(1))
    assert lean_step.applies(full, rows) and lean_step.applies(alone, rows)
    with torch.inference_mode():
        together = model(full, [(k.clone(), v.clone()) for k, v in caches])
        single = model(alone, [(k.clone(), v.clone()) for k, v in caches])
    assert torch.equal(together[:1], single)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _ops(model, batch: ForwardBatch, caches) -> list[str]:
    with torch.inference_mode():
        model(batch, caches)
        counter = _OpCounter()
        with counter:
            model(batch, caches)
    return counter.ops


def test_a_lean_step_dispatches_no_op_per_layer_but_its_products_buffers(lib, tiny_dirs, monkeypatch):
    """A one-row float32 step of the tiny Llama (packed, gate/up fused): its products and the LM head's are the
    library's (``lean_gemv.c``, on the plain weights kept beside the packed ones), so a layer dispatches only
    its four products' output buffers, and the whole step a fixed handful of ops more (embedding, rotary rows,
    buffers, the final norm, sampling's inputs, the index check), where the torch ops' step dispatches ~35 a layer."""
    monkeypatch.setenv(F32_PACKED_ENV, "1")
    model = load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=64)
    assert all(lean_step.plain_weight(m) is not None for m in model.model.layers.modules()
               if isinstance(m, packed_linears.PackedLinear))  # kept beside oneDNN's copies for the lean step
    layers = len(model.model.layers)
    gen = torch.Generator().manual_seed(7)
    caches = _filled_caches(model, gen)
    batch = _decode_batch(1, 20, gen)
    ops = _ops(model, batch, caches)
    plan = model.lean_plan
    assert plan is not None and _ops(model, batch, caches) == ops and model.lean_plan is plan  # built once
    assert not PRODUCT_OPS & set(ops), ops
    assert ops.count("empty") >= 4 * layers + 1  # each product's output, the head's
    # A fixed handful: embedding, rotary rows, buffers, the final norm, sampling's inputs, and the numpy views of the
    # three index tensors that ``check_cache_indices`` reads (four dispatches each).
    assert len(ops) - (4 * layers + 1) <= 32, ops
    kernels, model.lean_kernels = model.lean_kernels, None
    torch_ops = _ops(model, batch, caches)
    model.lean_kernels = kernels
    assert len(torch_ops) - len(ops) >= 25 * layers


def test_float32_weights_past_the_plain_copy_budget_multiply_through_onednn(lib, tiny_dirs, monkeypatch):
    """Past ``LEAN_PLAIN_MAX_BYTES`` a packed float32 linear holds only oneDNN's copy: the lean step calls its
    packed product (four a layer), with the same logits within float32 rounding; the LM head, whose plain
    weight is the embedding's, stays the library's."""
    monkeypatch.setenv(F32_PACKED_ENV, "1")
    monkeypatch.setattr(packed_linears, "LEAN_PLAIN_MAX_BYTES", 0)
    model = load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=64)
    assert all(lean_step.plain_weight(m) is None for m in model.model.layers.modules()
               if isinstance(m, packed_linears.PackedLinear))
    assert model.lean_max_rows == lean_step.LEAN_MAX_ROWS  # more rows were measured with the library's products
    gen = torch.Generator().manual_seed(7)
    caches = _filled_caches(model, gen)
    batch = _decode_batch(1, 20, gen)
    ops = _ops(model, batch, caches)
    assert ops.count("_linear_pointwise") == 4 * len(model.model.layers), ops
    want, got, _, _ = _both_ways(model, batch, caches)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen2-biases"])
def test_a_verify_step_of_long_context_takes_the_lean_step_with_the_torch_ops_logits(lib, tiny_dirs, name,
                                                                                     monkeypatch):
    """Speculation's verify step, one request's ``model.lean_max_rows`` positions as decode rows over the same
    blocks (each row's context one longer: it sees the keys the rows before it write in this step), 130 tokens of
    context: float32 logits and caches within float32 rounding of the torch ops'."""
    monkeypatch.setenv(F32_PACKED_ENV, "1")
    model = load_model(tiny_dirs[name], torch.float32, CPU, max_positions=256)
    gen = torch.Generator().manual_seed(11)
    caches = _filled_caches(model, gen)
    rows = model.lean_max_rows
    table = 1 + torch.randperm(39, generator=gen)
    lens = 130 + torch.arange(rows)
    pos = lens - 1
    batch = ForwardBatch(torch.randint(3, 250, (rows,), generator=gen), pos, table[pos // BLOCK] * BLOCK + pos % BLOCK,
                         rows, table.expand(rows, -1).contiguous(), lens, [], torch.arange(rows))
    assert lean_step.applies(batch, rows)
    want, got, kv_want, kv_got = _both_ways(model, batch, caches)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (kw, vw), (kg, vg) in zip(kv_want, kv_got):
        torch.testing.assert_close(kg, kw, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vg, vw, rtol=1e-5, atol=1e-5)


def test_the_row_limit_rises_only_where_more_rows_were_measured():
    """Past ``LEAN_MAX_ROWS`` rows only with the lean step's own products on AVX512-BF16 without AMX (the CPU
    class ``rows_sweep`` measured); AMX, AVX2 and int8 models (their own products) keep the default."""
    zen4 = frozenset({"avx512f", "avx512_bf16"})
    assert lean_step.lean_max_rows(torch.bfloat16, True, zen4) == lean_step.MEASURED_MAX_ROWS[torch.bfloat16] > 5
    assert lean_step.lean_max_rows(torch.float32, True, zen4) == lean_step.MEASURED_MAX_ROWS[torch.float32] > 5
    for flags in (zen4 | {"amx_bf16"}, frozenset({"avx2"}), frozenset()):
        assert lean_step.lean_max_rows(torch.bfloat16, True, flags) == lean_step.LEAN_MAX_ROWS
    assert lean_step.lean_max_rows(torch.float32, False, zen4) == lean_step.LEAN_MAX_ROWS


def test_an_int8_model_keeps_the_default_row_limit(lib, tiny_dirs):
    model = load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=64, quantization="int8")
    assert model.lean_kernels is not None and model.lean_max_rows == lean_step.LEAN_MAX_ROWS


def test_steps_the_lean_step_does_not_serve_keep_the_torch_ops(lib, tiny_dirs, monkeypatch):
    monkeypatch.setenv(F32_PACKED_ENV, "1")
    model = load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=4096)
    gen = torch.Generator().manual_seed(8)
    limit = model.lean_max_rows
    more = _decode_batch(limit + 1, 20, gen)
    assert not lean_step.applies(more, limit)
    assert lean_step.applies(_decode_batch(limit, 20, gen), limit)
    prefill = ForwardBatch(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.tensor([4, 5]), 0,
                           torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                           [PrefillRow(0, 2, 2, torch.tensor([1]))], torch.arange(2))
    assert not lean_step.applies(prefill, limit)
    caches = model.new_kv_caches(1 + more.decode_block_tables.numel(), BLOCK)
    assert "rms_norm" in _ops(model, more, caches)  # the torch ops' norms: the lean step did not run
    qwen3 = load_model(tiny_dirs["qwen3"], torch.float32, CPU, max_positions=64)
    assert qwen3.lean_kernels is None  # its q/k norms are not in the kernels


def test_without_a_compiler_the_model_keeps_the_torch_ops(tiny_dirs, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ASYNCBATCH_CACHE", str(tmp_path / "cache"))
    assert lean_kernels.library.__wrapped__() is None
    monkeypatch.setattr(lean_kernels, "library", lean_kernels.library.__wrapped__)
    model = load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=64)
    assert model.lean_kernels is None
    monkeypatch.setenv(lean_kernels.LEAN_STEP_ENV, "0")
    assert not lean_kernels.wanted()


@pytest.mark.parametrize("refused", ["-march=native", "-fopenmp"])
def test_a_compiler_refusing_a_flag_builds_a_library_that_works(lib, monkeypatch, tmp_path, refused):
    """Some ARM compilers refuse ``-march=native`` (the build is retried for the baseline ISA, where the products
    take their portable loop), and clang without libomp refuses ``-fopenmp`` (retried single-threaded): either
    way the library builds, passes its own checks and computes a norm and a product."""
    real = shutil.which("cc") or shutil.which("gcc")
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{refused}" ] && exit 1; done\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("ASYNCBATCH_CACHE", str(tmp_path / "cache"))
    built = lean_kernels.library.__wrapped__()
    assert built is not None and list((tmp_path / "cache" / "kernels").glob("*/lean_cpu.so"))
    x, w, out = torch.randn(2, 40), torch.ones(40), torch.empty(2, 40)
    built.ab_rms_norm(x.data_ptr(), 0, 2, 40, w.data_ptr(), 0, 1e-5, 0, out.data_ptr(), 0)
    torch.testing.assert_close(out, torch.rms_norm(x, (40,), w, 1e-5))
    weight, product = torch.randn(100, 40), torch.empty(2, 100)
    built.ab_gemv(x.data_ptr(), 2, 40, weight.data_ptr(), 0, None, 0, 100, product.data_ptr(), 2)
    torch.testing.assert_close(product, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_model_with_a_linear_float16_cannot_hold_still_takes_the_lean_step(lib, tiny_dirs, monkeypatch):
    """Where a weight holds a value float16 cannot (``fp16_kernel.pack_fp16`` refuses it), that linear keeps oneDNN's
    bfloat16 product: with the q/k/v one among them the step's inputs are bfloat16, which the other linears'
    float16 copies take after a cast."""
    from asyncbatch.model import fp16_kernel

    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "1")
    model = load_model(tiny_dirs["llama"], torch.bfloat16, CPU, max_positions=64)
    if getattr(model.model.layers[0].self_attn.qkv_proj, "fp16", None) is None:
        pytest.skip("no float16 copies here (oneDNN's packed bfloat16 product or fbgemm's kernel is missing)")
    gen = torch.Generator().manual_seed(9)
    caches = _filled_caches(model, gen)
    batch = _decode_batch(1, 20, gen)
    want, got, _, _ = _both_ways(model, batch, caches)
    for layer in model.model.layers:
        layer.self_attn.qkv_proj.fp16 = None  # as pack_fp16 leaves a linear it refuses
    model.lean_plan = None
    _, mixed, _, _ = _both_ways(model, batch, caches)
    torch.testing.assert_close(mixed, got, rtol=0, atol=0.1)
    assert torch.equal(mixed.argmax(-1), want.argmax(-1))


def test_a_library_that_computes_wrong_is_not_used(lib):
    class Broken:
        def __init__(self, real) -> None:
            self.real = real

        def ab_rms_norm(self, *args) -> None:  # leaves the output as it was: zeros
            return None

        def ab_gemv(self, *args) -> None:  # the same: zeros, where the check's sums are not all zero
            return None

    assert lean_kernels._norm_works(lib) and lean_kernels._product_works(lib)
    assert not lean_kernels._norm_works(Broken(lib))
    assert not lean_kernels._product_works(Broken(lib))


@pytest.mark.parametrize("broken", ["slot", "block", "short-table"])
def test_a_step_indexing_past_the_cache_raises_as_the_torch_ops_do_and_writes_nothing(lib, tiny_dirs, broken):
    """The C kernels index the caches unchecked: a slot or a block past the cache must raise before they run (an
    IndexError, as torch's indexing raises on the same step), not write or read outside the cache's memory. A
    context longer than its row's table raises too (the torch ops attend over the table's width and mask the
    rest, so they do not; the kernel would read past the row's table)."""
    model = load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=64)
    gen = torch.Generator().manual_seed(8)
    blocks = 40
    caches = _filled_caches(model, gen, blocks)
    batch = _decode_batch(2, 30, gen)
    if broken == "slot":
        batch.slot_mapping[1] = blocks * BLOCK + 3
    elif broken == "block":
        batch.decode_block_tables[0, 2] = blocks + 7  # a block row 0's context reads
    else:
        batch.decode_context_lens[1] = batch.decode_block_tables.shape[1] * BLOCK + 1
    kernels = model.lean_kernels
    for lean in (False, True) if broken != "short-table" else (True,):
        model.lean_kernels = kernels if lean else None
        kv = [(k.clone(), v.clone()) for k, v in caches]
        with torch.inference_mode(), pytest.raises(IndexError):
            model(batch, kv)
        if lean:  # nothing was written: the check runs before the first layer's kernels
            assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv, caches))
    model.lean_kernels = kernels


def test_a_block_past_a_rows_context_is_not_checked():
    """A table's padding past a row's context (the engine pads tables to the widest row) is never read."""
    tables = torch.tensor([[0, 1, 999], [2, -1, -1]])
    lean_step.check_cache_indices(tables, torch.tensor([2 * BLOCK, 1]), torch.tensor([0, 2 * BLOCK]), 3, BLOCK)
    with pytest.raises(IndexError, match="block 999"):
        lean_step.check_cache_indices(tables, torch.tensor([2 * BLOCK + 1, 1]), torch.tensor([0, 1]), 3, BLOCK)
    with pytest.raises(TypeError, match="int64"):
        lean_step.check_cache_indices(tables.int(), torch.tensor([1, 1]), torch.tensor([0, 1]), 3, BLOCK)


def _with_prefill(batch: ForwardBatch, gen: torch.Generator, q_len: int = 6) -> ForwardBatch:
    """``batch``'s decode rows and a prefill chunk of ``q_len`` tokens after them, in blocks of its own (a fresh
    context: the first ``q_len`` slots of blocks 30-31, past every decode row's)."""
    nd = batch.num_decode
    table = torch.tensor([30, 31])
    pos = torch.arange(q_len)
    return ForwardBatch(torch.cat([batch.input_ids, torch.randint(3, 250, (q_len,), generator=gen)]),
                        torch.cat([batch.positions, pos]),
                        torch.cat([batch.slot_mapping, table[pos // BLOCK] * BLOCK + pos % BLOCK]), nd,
                        batch.decode_block_tables, batch.decode_context_lens, [PrefillRow(nd, q_len, q_len, table)],
                        torch.cat([batch.logits_indices, torch.tensor([nd + q_len - 1])]))


@pytest.mark.parametrize("prefill", [False, True], ids=["decode-only", "with-a-prefill-chunk"])
@pytest.mark.parametrize("name", ["llama", "qwen2-biases"])
def test_a_step_past_the_row_limit_attends_with_the_kernel_and_gives_the_torch_ops_logits(lib, tiny_dirs, name,
                                                                                          prefill):
    """More decode rows than the lean step takes: the torch ops run the step, but its decode rows attend with the
    lean kernel, in place (no page gather, no SDPA for them), and the logits and caches are the torch ops' own
    up to float32's order of sums; a prefill chunk beside them keeps torch's attention."""
    model = load_model(tiny_dirs[name], torch.float32, CPU, max_positions=64)
    gen = torch.Generator().manual_seed(9)
    rows = model.lean_max_rows + 2
    batch = _decode_batch(rows, 24, gen)  # tables [rows, 7] of blocks 1-84: a cache of 90 blocks
    caches = _filled_caches(model, gen, blocks=90)
    if prefill:
        batch = _with_prefill(batch, gen)
    assert not lean_step.applies(batch, model.lean_max_rows)
    want, got, kv_want, kv_got = _both_ways(model, batch, caches)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (kw, vw), (kg, vg) in zip(kv_want, kv_got):  # later layers' keys and values: from the attention's output
        torch.testing.assert_close(kg, kw, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vg, vw, rtol=1e-5, atol=1e-5)
    ops = _ops(model, batch, caches)
    kernels, model.lean_kernels = model.lean_kernels, None
    torch_ops = _ops(model, batch, caches)
    model.lean_kernels = kernels
    sdpa = {op for op in torch_ops if "scaled_dot_product" in op}
    assert sdpa, torch_ops  # torch's decode attention: a gather of the pages and SDPA in every layer
    layers = len(model.model.layers)
    assert sum(op in sdpa for op in ops) == (layers if prefill else 0), ops  # the prefill chunk's alone
    assert ops.count("index_select") < torch_ops.count("index_select")


def test_a_bfloat16_step_past_the_row_limit_stays_within_bfloat16_rounding_of_the_torch_ops(lib, tiny_dirs,
                                                                                          monkeypatch):
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    model = load_model(tiny_dirs["llama"], torch.bfloat16, CPU, max_positions=64)
    ref = load_model(tiny_dirs["llama"], torch.float32, CPU, max_positions=64)
    gen = torch.Generator().manual_seed(10)
    batch = _decode_batch(model.lean_max_rows + 2, 24, gen)
    caches = _filled_caches(model, gen, blocks=90)
    assert not lean_step.applies(batch, model.lean_max_rows)
    want, got, _, _ = _both_ways(model, batch, caches)
    with torch.inference_mode():
        exact = ref(batch, [(k.float(), v.float()) for k, v in caches])
    # No farther from the float32 model than bfloat16's torch ops are (no argmax compared: twelve rows of a tiny random
    # model hold near-ties, and bfloat16's last bits depend on the CPU's vector width).
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + 0.05


def test_float32_and_bfloat16_steps_take_the_kernel_at_any_context(lib):
    """No context threshold (measured faster than torch's attention at 128 tokens a row and up, in both dtypes):
    a short bfloat16 step takes the kernel as a long one does; caches in another dtype than the step's never."""
    gen = torch.Generator().manual_seed(11)
    batch = _decode_batch(3, 24, gen)
    for dtype in (torch.float32, torch.bfloat16):
        caches = [(torch.zeros(90, BLOCK, 1, 64, dtype=dtype),) * 2]
        assert lean_attention.decode_attention_kernel(lib, batch, caches, dtype) is not None
    caches = [(torch.zeros(90, BLOCK, 1, 64, dtype=torch.bfloat16),) * 2]
    assert lean_attention.decode_attention_kernel(lib, batch, caches, torch.float32) is None  # caches not in dtype
