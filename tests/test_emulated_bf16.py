"""bfloat16 on a CPU without bfloat16 kernels: bfloat16 values, float32 GEMMs (asyncbatch/model/emulated_bf16.py).

The emulated linear must be exactly "round the inputs and weights to bfloat16, multiply and sum in float32,
round the output to bfloat16"; a loaded model must swap every float linear and the LM head and stay within
bfloat16 rounding of torch's own bfloat16 path; the switch follows the hardware, not the faked flags.
"""

from __future__ import annotations

import pytest
import torch
from harness.decode_step import decode_batch
from tiny_models import save_tiny_model
from torch import nn

from asyncbatch.model import emulated_bf16
from asyncbatch.model.emulated_bf16 import EMULATION_ENV, EmulatedBf16Linear, emulates_bf16
from asyncbatch.model.loader import load_model

CPU = torch.device("cpu")


def test_the_linear_is_a_float32_product_of_bfloat16_values_rounded_to_bfloat16():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(7, 40, generator=gen).to(torch.bfloat16)
    linear = EmulatedBf16Linear(weight, bias)
    assert linear.weight.dtype == torch.float32
    assert torch.equal(linear.weight, weight.to(torch.bfloat16).float())  # bfloat16 values, held in float32
    expected = torch.nn.functional.linear(x.float(), weight.to(torch.bfloat16).float(),
                                          bias.to(torch.bfloat16).float()).to(torch.bfloat16)
    got = linear(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    head = EmulatedBf16Linear(weight, None, out_dtype=torch.float32)
    assert head(x).dtype == torch.float32


def test_the_switch_follows_the_hardware_and_the_override(monkeypatch):
    monkeypatch.delenv(EMULATION_ENV, raising=False)
    monkeypatch.setattr(emulated_bf16, "hardware_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert emulates_bf16(torch.bfloat16, CPU)
    assert not emulates_bf16(torch.float32, CPU) and not emulates_bf16(torch.float16, CPU)
    assert not emulates_bf16(torch.bfloat16, torch.device("cuda"))
    monkeypatch.setenv("ASYNCBATCH_CPU_FLAGS", "amx_bf16")  # fakes what `auto` sees, not the kernels
    assert emulates_bf16(torch.bfloat16, CPU)
    monkeypatch.setattr(emulated_bf16, "hardware_cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert not emulates_bf16(torch.bfloat16, CPU)
    monkeypatch.setenv(EMULATION_ENV, "1")
    assert emulates_bf16(torch.bfloat16, CPU)
    monkeypatch.setenv(EMULATION_ENV, "0")
    monkeypatch.setattr(emulated_bf16, "hardware_cpu_flags", lambda: frozenset({"avx2"}))
    assert not emulates_bf16(torch.bfloat16, CPU)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_loaded_model_is_emulated_throughout_and_agrees_with_torchs_bfloat16(tmp_path, monkeypatch, tied):
    path = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM", tie_word_embeddings=tied)
    monkeypatch.setenv(EMULATION_ENV, "1")
    emulated = load_model(path, torch.bfloat16, CPU, max_positions=64)
    monkeypatch.setenv(EMULATION_ENV, "0")
    native = load_model(path, torch.bfloat16, CPU, max_positions=64)
    exact = load_model(path, torch.float32, CPU, max_positions=64)
    assert not any(isinstance(m, nn.Linear) for m in emulated.modules())
    # Every projection is emulated: per layer q/k/v fused at load (``fused_projections``), o, gate, up and
    # down, so 5 linears per layer (7 before the fusion), and the head.
    assert sum(isinstance(m, EmulatedBf16Linear) for m in emulated.modules()) == 2 * 5 + 1
    assert not emulated.lm_head_reads_embedding and native.emulated_lm_head is None
    logits = {}
    for name, model in (("emulated", emulated), ("native", native), ("float32", exact)):
        kv = model.new_kv_caches(16, 16)
        with torch.inference_mode():
            logits[name] = model(decode_batch(4, 20, vocab=300), kv)
        assert logits[name].dtype == torch.float32 and logits[name].shape == (4, 300)
    # Both bfloat16 paths are within bfloat16 rounding of float32 (a few units of 2^-8 relative), not equal.
    scale = logits["float32"].abs().max()
    for name in ("emulated", "native"):
        assert (logits[name] - logits["float32"]).abs().max() < 0.05 * scale, name
    assert (logits["emulated"] - logits["native"]).abs().max() < 0.05 * scale


def test_the_engine_says_when_it_emulates(make_llm, tmp_path, monkeypatch):
    path = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM")
    monkeypatch.setenv(EMULATION_ENV, "1")
    llm = make_llm(str(path), device="cpu", dtype="bfloat16", engine_process=False, num_threads=1)
    assert "float32 kernels" in llm.executor_info["dtype_choice"]
    monkeypatch.setenv(EMULATION_ENV, "0")
    other = make_llm(str(path), device="cpu", dtype="bfloat16", engine_process=False, num_threads=1)
    assert "float32 kernels" not in other.executor_info["dtype_choice"]
