"""CPU weight precisions: ``quantization=`` (int8, int4, w8a8) and ``dtype="auto"``'s choice.

Tolerances (relative L2 error of a forward's logits against the float32 model on the
tiny random models, whose weights are far less regular than a trained model's):
int8 3 %, w8a8 8 %, int4 30 %, bfloat16 3 % (measured: 1.7-2.0 %, 4.3-4.9 %, 24 %, 1.1 %). The real model's figures are the
quality script's (teacher-forced agreement and perplexity, docs/cpu-precision.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_checks import assert_idle_and_clean
from tiny_models import save_tiny_model

from asyncbatch import SamplingParams
from asyncbatch.config import EngineConfig
from asyncbatch.model import fp16_kernel, lean_kernels, lean_step, llama, packed_linears
from asyncbatch.model import quantization as quant
from asyncbatch.model.cpu_features import CPU_FLAGS_ENV, choose_cpu_dtype, cpu_flags, hardware_cpu_flags
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.loader import explain_dtype, load_model

TOLERANCE = {"int8": 0.03, "w8a8": 0.08, "int4": 0.30, "bfloat16": 0.03}
BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {arch: save_tiny_model(root / arch, arch, tie_word_embeddings=arch == "LlamaForCausalLM")
            for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM")}


def _prefill_then_decode(model, prompt_len: int, decode_rows: int) -> torch.Tensor:
    """Logits of a prefill of ``prompt_len`` tokens (all positions), then of ``decode_rows`` decode rows that
    each continue a copy of that context (so a forward sees both many and few rows)."""
    gen = torch.Generator().manual_seed(0)
    per_row = -(-(prompt_len + 1) // BLOCK)
    kv = model.new_kv_caches(1 + per_row * (decode_rows + 1), BLOCK)
    ids = torch.randint(3, 250, (prompt_len,), generator=gen)
    outs = []
    with torch.inference_mode():
        for row in range(decode_rows):
            table = 1 + row * per_row + torch.arange(per_row)
            pos = torch.arange(prompt_len)
            batch = ForwardBatch(ids, pos, table[pos // BLOCK] * BLOCK + pos % BLOCK, 0,
                                 torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                 [PrefillRow(0, prompt_len, prompt_len, table[:-(-prompt_len // BLOCK)])],
                                 torch.arange(prompt_len))
            logits = model(batch, kv)
            if row == 0:
                outs.append(logits)
        tables = 1 + torch.arange(decode_rows)[:, None] * per_row + torch.arange(per_row)[None, :]
        pos = torch.full((decode_rows,), prompt_len)
        batch = ForwardBatch(torch.randint(3, 250, (decode_rows,), generator=gen), pos,
                             tables[:, prompt_len // BLOCK] * BLOCK + prompt_len % BLOCK, decode_rows, tables,
                             torch.full((decode_rows,), prompt_len + 1), [], torch.arange(decode_rows))
        outs.append(model(batch, kv))
    return torch.cat(outs)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("precision", ["int8", "int4", "w8a8", "bfloat16"])
def test_each_precision_matches_float32_within_tolerance(tiny_dirs, arch, precision):
    path = tiny_dirs[arch]
    reference = _prefill_then_decode(load_model(path, torch.float32, "cpu", 64), 20, 3)
    dtype, scheme = (torch.bfloat16, None) if precision == "bfloat16" else (torch.float32, precision)
    model = load_model(path, dtype, "cpu", 64, quantization=scheme)
    if scheme is not None:
        assert model.quantization == scheme
        assert all(isinstance(getattr(module, n), quant.QuantizedLinear) for layer in model.model.layers
                   for module, n in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                     (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")))
        assert not hasattr(model.model.layers[0].self_attn, "q_proj")
        assert model.quantized_lm_head.scheme == ("int8" if scheme == "int4" else scheme)
        assert not model.lm_head_reads_embedding
        assert quant.weight_bytes(model) < quant.weight_bytes(load_model(path, torch.float32, "cpu", 64))
    got = _prefill_then_decode(model, 20, 3)
    assert got.dtype == torch.float32 and got.shape == reference.shape
    error = _relative_error(got, reference)
    assert error < TOLERANCE[precision], f"{precision}: relative error {error:.4f}"


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_quantized_linear_rows_are_independent_of_the_batch(scheme):
    """A row's output is the same alone and inside a batch."""
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 64, generator=gen) * 0.1, torch.randn(96, generator=gen)
    layer = quant.QuantizedLinear(weight, bias, scheme)
    x = torch.randn(40, 64, generator=gen)
    x[5] *= 30.0  # an outlier row must not change the others' grid
    exact = x @ weight.T + bias
    for rows in (3, 40):
        batch = layer(x[:rows])
        alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
        torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)
        assert _relative_error(batch, exact[:rows]) < TOLERANCE[scheme]


@pytest.mark.skipif(quant.unavailable_reason("w8a8") is not None, reason="this torch build has no fbgemm")
def test_w8a8_handles_are_reused_once_their_linear_is_freed():
    """Compiled graphs bake the handles in: a model built after an earlier one was freed must get the same
    handles (so inductor's cache serves its graphs); linears alive at once never share one."""
    import gc

    # Linears an earlier test left in reference cycles (a compiled engine's model) hold handles until a collection:
    # collect them first, or the one below frees them between ``first`` and ``second`` and lowers the free handles.
    gc.collect()
    weight = torch.randn(16, 32)
    first = [quant.QuantizedLinear(weight, None, "w8a8") for _ in range(3)]
    handles = [layer._handle for layer in first]
    assert len(set(handles)) == 3 and all(quant._W8A8_PACKED[h][0] is layer._packed for h, layer in zip(handles, first))
    del first
    gc.collect()
    assert not set(handles) & set(quant._W8A8_PACKED)
    second = [quant.QuantizedLinear(weight, None, "w8a8") for _ in range(3)]
    assert [layer._handle for layer in second] == handles
    x = torch.randn(2, 32)
    torch.testing.assert_close(torch.ops.asyncbatch.w8a8_linear(torch.cat((x, second[1].sentinel)), handles[1]),
                               torch.ops.quantized.linear_dynamic(torch.cat((x, second[1].sentinel)),
                                                                  second[1]._packed, quant.W8A8_REDUCE_RANGE))


def test_unsupported_combinations_raise_value_errors_naming_quantization(monkeypatch):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    for device in ("cuda", "sim"):
        with pytest.raises(ValueError, match="quantization"):
            EngineConfig(device=device, quantization="int8")
    with pytest.raises(ValueError, match="quantization"):
        quant.check_quantization("int8", "cuda")
    with pytest.raises(ValueError, match="quantization"):
        quant.check_quantization("w8a8", "cpu", torch.float16)
    with pytest.raises(ValueError, match="quantization='int4'.*in_features"):
        quant.QuantizedLinear(torch.randn(8, 48), None, "int4")
    monkeypatch.setattr(quant, "_has_op", lambda name: False)
    with pytest.raises(ValueError, match="quantization='int4' is not available.*_weight_int4pack_mm_for_cpu"):
        quant.check_quantization("int4", "cpu")
    with pytest.raises(ValueError, match="quantization='int8' is not available"):
        quant.check_quantization("int8", "cpu")


def test_auto_dtype_follows_the_cpu_features():
    assert choose_cpu_dtype(frozenset({"avx2", "fma", "f16c"}), "AVX2").dtype == torch.float32
    assert "no native bfloat16" in choose_cpu_dtype(frozenset({"avx2"}), "AVX2").reason
    assert choose_cpu_dtype(frozenset({"avx512f", "avx512_bf16"}), "AVX512").dtype == torch.bfloat16
    assert choose_cpu_dtype(frozenset({"avx512f", "amx_bf16", "amx_tile"}), "AVX512").dtype == torch.bfloat16
    assert choose_cpu_dtype(frozenset(), "DEFAULT").dtype == torch.float32
    cpuinfo = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n"
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags("Features\t: fp asimd bf16\n") == frozenset({"fp", "asimd", "bf16"})
    assert cpu_flags("") == frozenset()


def test_cpu_flags_switch_fakes_the_cpu(monkeypatch):
    """ASYNCBATCH_CPU_FLAGS replaces /proc/cpuinfo's flags, so one machine runs both sides of auto."""
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx2 amx_bf16")
    assert cpu_flags() == frozenset({"avx2", "amx_bf16"})
    choice = choose_cpu_dtype()
    assert choice.dtype == torch.bfloat16 and "faked by ASYNCBATCH_CPU_FLAGS" in choice.reason
    assert explain_dtype("auto", "cpu")[0] == torch.bfloat16
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx2,fma")
    assert choose_cpu_dtype().dtype == torch.float32
    assert explain_dtype("auto", "cpu")[0] == torch.float32
    assert explain_dtype("float32", "cpu")[0] == torch.float32  # a named dtype ignores the flags
    monkeypatch.delenv(CPU_FLAGS_ENV)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        assert cpu_flags() == cpu_flags(cpuinfo.read_text())


def overlap_and_sync_tokens(make_llm, path: str, num_requests: int, check_llm=lambda llm: None,
                            **engine_kwargs) -> list[list[list[int]]]:
    """Each request's tokens from an overlap engine and a synchronous one (in that order), on ``num_requests``
    mixed requests of the tiny Llama (greedy and seeded, 6 + 3 i tokens), integrity checked every step."""
    prompts = [[3 + (i * 31 + j * 7) % 250 for j in range(3 + i * 5)] for i in range(num_requests)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(num_requests)]
    runs = []
    for overlap in (True, False):
        llm = make_llm(path, device="cpu", overlap=overlap, max_num_batched_tokens=24, block_size=4,
                       debug_check_integrity=True, **engine_kwargs)
        check_llm(llm)
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert_idle_and_clean(llm)
    assert [len(t) for t in runs[0]] == [6 + 3 * i for i in range(num_requests)]
    return runs


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_overlap_equals_sync_for_each_precision(make_llm, tiny_dirs, scheme):
    def check(llm) -> None:
        info = llm.executor_info
        assert info["quantization"] == scheme and info["dtype"] == "float32"

    overlap, sync = overlap_and_sync_tokens(make_llm, str(tiny_dirs["LlamaForCausalLM"]), 8, check,
                                            dtype="float32", quantization=scheme, max_num_seqs=6)
    assert overlap == sync


@pytest.mark.parametrize("lean", ["0", "1"], ids=["torch-ops", "lean-step-own-products"])
def test_overlap_equals_sync_with_the_float16_weight_kernel(make_llm, tiny_dirs, monkeypatch, lean):
    """bfloat16 with fbgemm's float16 copies forced on (``fp16_kernel``): the engine's one- and two-row steps run
    their decoder products through the kernel, from ``PackedLinear`` under torch's ops or under the lean CPU step
    on each linear's own product (``ASYNCBATCH_CPU_LEAN_PRODUCTS=0``), larger ones through oneDNN, and overlap
    gives synchronous mode's tokens."""
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "1")
    monkeypatch.setenv(lean_kernels.LEAN_STEP_ENV, lean)
    monkeypatch.setenv(lean_kernels.LEAN_PRODUCTS_ENV, "0")
    if not packed_linears.packs_weights(torch.bfloat16, torch.device("cpu")) or not fp16_kernel.fp16_kernel_works():
        pytest.skip("oneDNN's packed bfloat16 product or fbgemm's float16-weight kernel is missing here")
    if lean == "1" and lean_kernels.library() is None:
        pytest.skip("no C compiler here: the lean CPU step's kernels cannot be built")
    rows_seen: list[int] = []  # the rows of each decoder product through the kernel
    linear, product, inside = packed_linears.PackedLinear._forward_2d, packed_linears.fp16_product, []

    def spied_linear(self, x):  # the kernel's calls from inside a decoder linear (the LM head calls it too)
        inside.append(self)
        try:
            return linear(self, x)
        finally:
            inside.pop()
    monkeypatch.setattr(packed_linears.PackedLinear, "_forward_2d", spied_linear)
    monkeypatch.setattr(packed_linears, "fp16_product",
                        lambda x, w: (rows_seen.append(len(x)) if inside else None) or product(x, w))
    lean_steps = []
    layers = llama.lean_layers
    monkeypatch.setattr(llama, "lean_layers", lambda *args: lean_steps.append(1) or layers(*args))

    def check(llm) -> None:  # every decoder linear holds the kernel's copy, and the engine says so
        info = llm.executor_info
        assert info["fp16_kernel_linears"] == info["packed_linears"] > 0

    overlap, sync = overlap_and_sync_tokens(make_llm, str(tiny_dirs["LlamaForCausalLM"]), 5, check,
                                            dtype="bfloat16", engine_process=False, max_num_seqs=3)
    assert overlap == sync
    assert {1, 2} <= set(rows_seen) and max(rows_seen) <= fp16_kernel.FP16_KERNEL_MAX_ROWS
    assert bool(lean_steps) == (lean == "1")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlap_equals_sync_with_the_lean_steps_own_products(make_llm, tiny_dirs, monkeypatch, dtype):
    """The lean CPU step multiplying by ``lean_gemv.c`` (the default where it builds): steps of one to
    ``lean_max_rows`` rows (this CPU's limit) call it for every product and the LM head, larger ones keep
    oneDNN's; a bfloat16 model holds no float16 copy then; overlap gives synchronous mode's tokens, integrity
    checked every step."""
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    monkeypatch.setenv(packed_linears.F32_PACKED_ENV, "1")
    if not packed_linears.packs_weights(getattr(torch, dtype), torch.device("cpu")):
        pytest.skip(f"oneDNN's packed {dtype} product is missing here")
    lib = lean_kernels.library()
    if lib is None:
        pytest.skip("no C compiler here: the lean CPU step's kernels cannot be built")
    rows_seen: list[int] = []
    gemv = lib.ab_gemv
    monkeypatch.setattr(lib, "ab_gemv", lambda *args: rows_seen.append(args[1]) or gemv(*args))

    def check(llm) -> None:
        info = llm.executor_info
        assert info["packed_linears"] > 0 and info["fp16_kernel_linears"] == 0
        assert info["lean_max_rows"] == limit

    # The tiny model's steps reach ~8 decode rows here: a limit of six (on CPUs where more was measured; five
    # elsewhere) leaves steps above it, which must keep oneDNN's products.
    monkeypatch.setattr(lean_step, "MEASURED_MAX_ROWS", {torch.float32: 6, torch.bfloat16: 6})
    limit = lean_step.lean_max_rows(getattr(torch, dtype), True, hardware_cpu_flags())
    overlap, sync = overlap_and_sync_tokens(make_llm, str(tiny_dirs["LlamaForCausalLM"]), limit + 3, check,
                                            dtype=dtype, engine_process=False, max_num_seqs=limit + 2)
    assert overlap == sync
    assert {1, 2, limit} <= set(rows_seen) and max(rows_seen) == limit


@pytest.mark.auto_dtype
def test_executor_info_says_which_dtype_auto_chose(make_llm, tiny_dirs):
    llm = make_llm(str(tiny_dirs["LlamaForCausalLM"]), device="cpu", engine_process=False)
    info = llm.executor_info
    assert info["quantization"] is None
    assert info["dtype_choice"].startswith("auto -> ")
    assert info["dtype"] == str(llm.dtype).removeprefix("torch.")
