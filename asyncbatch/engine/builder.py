"""Assembles an engine from an ``EngineConfig``: ``resolve_model`` in the frontend (path, config, tokenizer),
``build_core`` in the engine core (weights, KV cache, executor, scheduler).

KV capacity: ``num_kv_blocks`` if given; otherwise a memory budget divided by
the bytes one token's keys and values take in every layer, a draft model's
layers included (``speculative_config`` with ``method="draft_model"``: its KV
cache mirrors the target's blocks, so each block costs both). The budget is
``kv_cache_memory_gib`` if given, else on CUDA ``gpu_memory_utilization`` of
the memory free after the weights and what steps and CUDA graphs will take
(measured by one worst-case profile step, ``executors.cuda_memory``), on CPU
2 GiB, on ``sim`` 16 GiB (a modelled GPU). Capacity never exceeds what
``max_num_seqs`` full-length requests need. Graphs are captured after the KV
cache exists (they bake in its addresses).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from asyncbatch.config import EngineConfig
from asyncbatch.engine.block_manager import BlockManager, blocks_for_tokens
from asyncbatch.engine.core import EngineCore
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.executors.base import Executor
from asyncbatch.executors.kernel_threads import one_kernel_thread
from asyncbatch.model.compiled_decode import check_compile_decode
from asyncbatch.model.emulated_bf16 import emulates_bf16
from asyncbatch.model.llama import CausalLM
from asyncbatch.model.loader import (
    explain_dtype,
    load_config,
    load_model,
    load_tokenizer,
    max_model_len,
    resolve_dtype,
    resolve_model_path,
)
from asyncbatch.model.quantization import check_quantization
from asyncbatch.speculative.draft_check import resolve_draft

if TYPE_CHECKING:
    from asyncbatch.speculative.draft_model import DraftModel

_GIB = 1 << 30


@dataclass(slots=True)
class ModelSpec:
    """What the frontend resolved about the model, handed to the core so it does not resolve it again."""

    path: Path
    device: str  # "cpu" | "cuda" | "sim" ("auto" resolved)
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    max_blocks_per_seq: int
    nvtx: bool = False  # NVTX ranges on in the core (the frontend's setting)
    draft_path: Path | None = None  # ``speculative_config.model`` resolved and checked (``draft_check``)


@dataclass(slots=True)
class ResolvedModel:
    """The frontend's side of the model: its spec, config and tokenizer (no weights; no tokenizer with
    ``skip_tokenizer_init``)."""

    spec: ModelSpec
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu', 'sim' or 'auto'")
    return name


def kv_bytes_per_token(hf_config: PretrainedConfig, dtype: torch.dtype) -> int:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * element


def choose_num_blocks(config: EngineConfig, device: str, bytes_per_token: int, max_len: int,
                      reserved_bytes: int = 0) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_gib is not None:
        budget = config.kv_cache_memory_gib * _GIB
    elif device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        budget = max(free - reserved_bytes, 0) * config.gpu_memory_utilization
    elif device == "sim":
        budget = 16 * _GIB
    else:
        budget = 2 * _GIB
    blocks = int(budget // (bytes_per_token * config.block_size))
    most_useful = config.max_num_seqs * blocks_for_tokens(max_len, config.block_size) + 1
    return max(2, min(blocks, most_useful))


def _kv_bytes(hf_config: PretrainedConfig, spec: ModelSpec, dtype: torch.dtype) -> int:
    """KV bytes of one token: the target's, plus the draft model's when there is one (it caches every token the
    target caches, in blocks of its own with the same ids)."""
    total = kv_bytes_per_token(hf_config, dtype)
    if spec.draft_path is not None:
        total += kv_bytes_per_token(load_config(spec.draft_path)[0], dtype)
    return total


def _eos_id(tokenizer: PreTrainedTokenizerBase | None, hf_config: PretrainedConfig) -> int | None:
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


def _tokenizer_for(config: EngineConfig, model_path: Path) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer, the one ``config.tokenizer`` names, or None with ``skip_tokenizer_init``;
    a folder without a usable tokenizer is a ``ValueError`` that says what to pass instead."""
    if config.skip_tokenizer_init:
        return None
    path = Path(config.tokenizer).expanduser() if config.tokenizer is not None else model_path
    if config.tokenizer is not None and not path.exists():
        raise ValueError(f"tokenizer path {str(path)!r} does not exist")
    try:
        tokenizer = load_tokenizer(path)
    except (ValueError, OSError) as exc:
        raise ValueError(
            f"no usable tokenizer in {str(path)!r} ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "pass tokenizer=PATH (--tokenizer) to a folder with tokenizer.json, or skip_tokenizer_init=True "
            "(--skip-tokenizer-init) to send and receive token ids only") from exc
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return tokenizer


def read_chat_template(template: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (vLLM's ``--chat-template``)."""
    candidate = Path(template).expanduser()
    if "{" not in template and len(template) < 4096:
        if not candidate.is_file():
            raise ValueError(f"chat_template {template!r} is neither a file nor a Jinja template")
        return candidate.read_text()
    return template


def resolve_model(config: EngineConfig) -> ResolvedModel:
    """Find the model (converting a GGUF once), read its config and tokenizer; loads no weights."""
    from asyncbatch.profiling.marks import nvtx_enabled

    device = resolve_device(config.device)
    if device != "sim":
        check_quantization(config.quantization, device, resolve_dtype(config.dtype, device))
    check_compile_decode(config.compile_decode, device, config.quantization)
    path = resolve_model_path(config.model, config.cache_dir)
    hf_config, _arch = load_config(path)
    tokenizer = _tokenizer_for(config, Path(path))
    model_max = max_model_len(hf_config)
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(f"max_model_len must be <= {model_max} for this model, got {config.max_model_len}")
    max_len = config.max_model_len or model_max
    draft_path = resolve_draft(config.speculative_config, Path(path), hf_config, tokenizer, max_len, config.cache_dir)
    spec = ModelSpec(path, device, max_len, int(hf_config.vocab_size), _eos_id(tokenizer, hf_config),
                     blocks_for_tokens(max_len, config.block_size), nvtx_enabled(), draft_path)
    return ResolvedModel(spec, hf_config, tokenizer)


def build_core(config: EngineConfig, spec: ModelSpec, send: Callable[[object], None]) -> EngineCore:
    """Load the weights, size the KV cache, and assemble executor, scheduler and planner (not started).

    On the cpu the building thread runs its kernels on one OpenMP thread, and the device thread alone on
    several (``kernel_threads``): a second thread with a pool of its own would slow every step."""
    with one_kernel_thread() if spec.device == "cpu" else contextlib.nullcontext():
        return _build_core(config, spec, send)


def _build_core(config: EngineConfig, spec: ModelSpec, send: Callable[[object], None]) -> EngineCore:
    device = spec.device
    hf_config, _arch = load_config(spec.path)
    max_len = spec.max_model_len
    executor: Executor
    if config.speculative_config is not None and device == "cuda":
        raise ValueError(f"speculative_config runs on the cpu and sim devices only (for now); this engine's device is "
                         f"{device!r}")
    if device == "sim":
        from asyncbatch.executors.sim_executor import SimExecutor

        num_blocks = choose_num_blocks(config, device, _kv_bytes(hf_config, spec, torch.bfloat16), max_len)
        executor = SimExecutor(config.sim, spec.vocab_size, spec.eos_token_id, config.max_num_seqs,
                               speculative=config.speculative_config is not None,
                               draft_model=spec.draft_path is not None,
                               num_speculative_tokens=0 if config.speculative_config is None
                               else config.speculative_config.num_speculative_tokens)
    else:
        from asyncbatch.executors.torch_executor import TorchExecutor

        dtype, dtype_choice = explain_dtype(config.dtype, device)
        torch_device = torch.device(device)
        if config.quantization is None and emulates_bf16(dtype, torch_device):
            dtype_choice += "; linears on float32 kernels, bfloat16 values (no bfloat16 dot products here)"
        model, kv_caches, draft, num_blocks = _load_weights(config, spec, hf_config, dtype, torch_device)
        if device == "cuda":
            from asyncbatch.executors.cuda_executor import CudaExecutor

            executor = CudaExecutor(model, kv_caches, config.max_num_seqs, torch_device,
                                    max_blocks_per_seq=spec.max_blocks_per_seq,
                                    enable_cuda_graphs=config.enable_cuda_graphs,
                                    cuda_graph_batch_sizes=config.cuda_graph_batch_sizes)
        else:
            executor = TorchExecutor(model, kv_caches, config.max_num_seqs, torch_device, dtype_choice=dtype_choice,
                                     compile_decode=config.compile_decode, speculative=config.speculative_config,
                                     max_model_len=max_len, draft=draft,
                                     num_threads=config.num_threads or os.cpu_count() or 1)
    blocks = BlockManager(num_blocks, config.block_size, config.max_num_seqs, spec.max_blocks_per_seq,
                          prefix_caching=config.enable_prefix_caching)
    scheduler = Scheduler(blocks, config.max_num_batched_tokens, eos_token_id=spec.eos_token_id,
                          priority=config.scheduling_policy == "priority",
                          speculative=config.speculative_config)
    return EngineCore(config, executor, scheduler, spec.max_blocks_per_seq, send, vocab_size=spec.vocab_size,
                      make_grammar_compiler=None if config.skip_tokenizer_init else partial(
                          grammar_compiler, config, spec))


def _load_weights(config: EngineConfig, spec: ModelSpec, hf_config: PretrainedConfig, dtype: torch.dtype,
                  torch_device: torch.device) -> tuple[CausalLM, list, DraftModel | None, int]:
    """The model, its KV cache sized to the budget (after CUDA's step memory is reserved) and the draft model if
    any: (model, kv_caches, draft, num_blocks)."""
    device, max_len = spec.device, spec.max_model_len
    pack = not config.compile_decode  # the compiler traces plain weights, not oneDNN's packed ones
    model = load_model(spec.path, dtype, torch_device, max_positions=max_len, quantization=config.quantization,
                       pack=pack)
    reserved = 0
    if device == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_gib is None:
        from asyncbatch.executors.cuda_memory import profile_step_memory

        reserved = profile_step_memory(model, config.max_num_seqs, config.max_num_batched_tokens,
                                       config.block_size, graphs=config.enable_cuda_graphs).reserve_bytes
    num_blocks = choose_num_blocks(config, device, _kv_bytes(hf_config, spec, dtype), max_len, reserved)
    kv_caches = model.new_kv_caches(num_blocks, config.block_size)
    draft = None
    if spec.draft_path is not None:  # its own KV cache, the target's block layout (``speculative.draft_model``)
        from asyncbatch.speculative.draft_model import DraftModel

        draft_model = load_model(spec.draft_path, dtype, torch_device, max_positions=max_len,
                                 quantization=config.quantization, pack=pack)
        draft = DraftModel(draft_model, draft_model.new_kv_caches(num_blocks, config.block_size), max_len)
    return model, kv_caches, draft, num_blocks


def grammar_compiler(config: EngineConfig, spec: ModelSpec):
    """The structured-output compiler of this model's tokenizer (built in the core on the first grammar)."""
    from asyncbatch.sampling.grammar import GrammarCompiler

    return GrammarCompiler(_tokenizer_for(config, spec.path), spec.vocab_size, spec.eos_token_id,
                           backend=config.structured_outputs_backend)
