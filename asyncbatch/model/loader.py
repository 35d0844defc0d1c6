"""From a user's ``model`` argument to a ready ``CausalLM`` and tokenizer.

Accepted forms of ``model``: ``None`` or an alias of the default model, a
Hugging Face model directory (``config.json`` plus safetensors weights, single
file or sharded), or a ``.gguf`` file, which is converted once into a cached
Hugging Face directory (see ``gguf_cache``). Nothing is downloaded.

Weights are loaded without random initialisation: the module is built with its
parameters on the ``meta`` device and the checkpoint tensors are assigned in
place, so load time is the time to read the safetensors files.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from asyncbatch.model import lean_kernels
from asyncbatch.model.cpu_features import choose_cpu_dtype, hardware_cpu_flags
from asyncbatch.model.default_model import DEFAULT_MODEL_ALIASES, default_gguf_path, is_default_model
from asyncbatch.model.emulated_bf16 import emulate_bf16_linears, emulates_bf16
from asyncbatch.model.fused_projections import ALL_GROUPS, FLOAT_GROUPS, fuse_projections
from asyncbatch.model.gguf_cache import convert_gguf
from asyncbatch.model.lean_step import lean_library, lean_max_rows, plain_weight
from asyncbatch.model.llama import SUPPORTED_ARCHITECTURES, CausalLM, use_direct_norms
from asyncbatch.model.packed_linears import pack_linears, packs_weights
from asyncbatch.model.quantization import check_quantization, quantize_model
from asyncbatch.model.tokenizer_cache import load_tokenizer_cached

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint entries the model recomputes instead of loading.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_KEYS_SHOWN = 10


def resolve_model_path(model: str | os.PathLike[str] | None, cache_dir: str | None = None) -> Path:
    """Hugging Face directory for ``model``; a GGUF file (or the default) is converted first."""
    if model is None or (isinstance(model, str) and is_default_model(model)):
        return convert_gguf(default_gguf_path(), cache_dir)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir():
        problem = "is a directory without config.json"
    elif path.exists():
        problem = "is a file that is not .gguf"
    else:
        problem = "does not exist"
    raise ValueError(
        f"model {str(model)!r} {problem}; accepted: None or {list(DEFAULT_MODEL_ALIASES)} for the default "
        "model, a Hugging Face model directory with config.json and safetensors weights, or a .gguf file "
        "(models are not downloaded from the Hub)"
    )


def load_config(path: str | os.PathLike[str]) -> tuple[PretrainedConfig, str]:
    """The model's config and its architecture name, checked against ``SUPPORTED_ARCHITECTURES``."""
    config = AutoConfig.from_pretrained(path)
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"config.json in {path} has no 'architectures' entry; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    arch = architectures[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} of {path} is not supported; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    return config, arch


def max_model_len(config: PretrainedConfig) -> int:
    """Longest context the model can serve: ``max_position_embeddings``, capped by an active sliding window.

    Attention here is always full, so beyond a sliding window the results
    would differ from the model's training; Qwen configs carry a window that
    only counts when ``use_sliding_window`` is set, Mistral's always counts.
    """
    length = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        length = min(length, int(window))
    return length


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``"auto"``: on CUDA bfloat16 when supported, else float16; on CPU bfloat16 only where the CPU has
    native bfloat16 dot products, else float32 (``cpu_features.choose_cpu_dtype``)."""
    return explain_dtype(name, device)[0]


def explain_dtype(name: str, device: torch.device | str) -> tuple[torch.dtype, str]:
    """``resolve_dtype`` and a sentence saying why that dtype."""
    if name == "auto":
        kind = torch.device(device).type
        if kind == "cuda":
            bf16 = torch.cuda.is_bf16_supported()
            return (torch.bfloat16, "bfloat16: auto on a CUDA device with bfloat16") if bf16 else (
                torch.float16, "float16: auto on a CUDA device without bfloat16")
        if kind == "cpu":
            choice = choose_cpu_dtype()
            return choice.dtype, f"auto -> {choice.reason}"
        return torch.float32, "float32: auto"
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPE_NAMES]}, got {name!r}")
    return DTYPE_NAMES[name], f"{name}: asked for"


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The folder's tokenizer; each call its own object over a tokenizer built once per process
    (``tokenizer_cache``)."""
    return load_tokenizer_cached(path)


def load_model(path: str | os.PathLike[str], dtype: torch.dtype, device: torch.device | str,
               max_positions: int, quantization: str | None = None, fuse: bool = True,
               pack: bool = True) -> CausalLM:
    """Build ``CausalLM`` from the directory's weights, in ``dtype`` on ``device``, frozen, in eval mode.

    Floating-point weights are cast to ``dtype``; the rotary tables stay float32
    (the model casts the rows it gathers). Missing or unexpected weights raise a
    ``ValueError`` listing them. ``quantization`` (CPU only: ``"int8"``, ``"int4"``, ``"w8a8"``) then swaps
    the projections and the LM head for quantized ones (``quantization.quantize_model``).

    q/k/v (and gate/up, for quantized and packed weights) are loaded under their checkpoint names, then
    fused into one linear (``fused_projections``); ``fuse=False`` keeps them separate (the tests' reference for
    the fusion; a quantized model is fused either way). bfloat16 weights on a CPU with bfloat16 dot products,
    and float32 weights on an AMD CPU, are packed for oneDNN (``packed_linears``) unless ``pack`` is False
    (``compile_decode`` traces the plain ones).
    """
    try:
        from accelerate import init_empty_weights
    except ImportError:  # built with real (random) parameters first: slower, same result
        init_empty_weights = None

    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    path = Path(path)
    config, arch = load_config(path)
    device = torch.device(device)
    check_quantization(quantization, device.type, dtype)
    # Parameters go to meta (no random init); buffers stay real because the rotary tables are computed
    # in __init__. The context patches nn.Module globally, so no other thread should build modules meanwhile.
    empty = init_empty_weights(include_buffers=False) if init_empty_weights else contextlib.nullcontext()
    with empty:
        model = CausalLM(config, arch, max_positions)
    state = read_state_dict(path, dtype, device)
    expected = set(model.state_dict())
    if model.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the alias as well
    _check_keys(path, expected, set(state))
    model.load_state_dict(state, strict=True, assign=True)
    del state  # the model holds the weights now: fusing below frees the separate q/k/v and gate/up ones
    emulated = quantization is None and emulates_bf16(dtype, device)
    packed = quantization is None and not emulated and pack and packs_weights(dtype, device)
    if fuse:  # gate/up too where the weights are packed: one packed product a layer (``pack_linears``)
        fuse_projections(model, ALL_GROUPS if packed else FLOAT_GROUPS)
    model.to(device)  # moves the rotary buffers; parameters are already there
    model = model.eval().requires_grad_(False)
    use_direct_norms(model, dtype, device)
    lean = lean_library(model, device)
    products = lean is not None and lean_kernels.products_wanted()
    if quantization is not None:
        quantize_model(model, quantization, path)
    elif emulated:
        emulate_bf16_linears(model)
    elif packed:
        pack_linears(model, lean_step=products)
    model.lean_kernels, model.lean_products = lean, products
    # More rows were measured with the library's own products only: where the weights are plain (not int8 codes,
    # nor float32 ones past ``LEAN_PLAIN_MAX_BYTES``, which keep their own products in the lean step).
    model.lean_max_rows = 0 if lean is None else lean_max_rows(
        dtype, products and plain_weight(model.model.layers[0].self_attn.qkv_proj) is not None, hardware_cpu_flags())
    return model


def read_state_dict(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint; floats cast to ``dtype``."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        for key, tensor in load_file(str(file), device="cpu").items():
            if key.endswith(_IGNORED_SUFFIXES):
                continue
            target = dtype if tensor.is_floating_point() else tensor.dtype
            state[key] = tensor.to(device=device, dtype=target)
    return state


def _weight_files(path: Path) -> list[Path]:
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"model directory {path} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX} "
                     "(only safetensors checkpoints are supported)")


def _check_keys(path: Path, expected: set[str], found: set[str]) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} weights: {missing[:_MAX_KEYS_SHOWN]}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} weights: {unexpected[:_MAX_KEYS_SHOWN]}")
    raise ValueError(f"checkpoint in {path} does not match the model: " + "; ".join(parts))
