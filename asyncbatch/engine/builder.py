"""Assembles an engine from an ``EngineConfig``: model, tokenizer, KV cache, executor, scheduler.

KV capacity: ``num_kv_blocks`` if given; otherwise a memory budget divided by
the bytes one token's keys and values take in every layer. The budget is
``kv_cache_memory_gib`` if given, else on CUDA ``gpu_memory_utilization`` of
the memory free after the weights and what steps and CUDA graphs will take
(measured by one worst-case profile step, ``executors.cuda_memory``), on CPU
2 GiB, on ``sim`` 16 GiB (a modelled GPU). Capacity never exceeds what
``max_num_seqs`` full-length requests need. Graphs are captured after the KV
cache exists (they bake in its addresses).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from asyncbatch.config import EngineConfig
from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.core import EngineCore
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.executors.base import Executor
from asyncbatch.model.loader import (
    load_config,
    load_model,
    load_tokenizer,
    max_model_len,
    resolve_dtype,
    resolve_model_path,
)

_GIB = 1 << 30


@dataclass(slots=True)
class BuiltEngine:
    core: EngineCore
    model_path: Path
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    device: str
    dtype: torch.dtype | None
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None


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
    most_useful = config.max_num_seqs * -(-max_len // config.block_size) + 1
    return max(2, min(blocks, most_useful))


def _eos_id(tokenizer: PreTrainedTokenizerBase, hf_config: PretrainedConfig) -> int | None:
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


def build_engine(config: EngineConfig) -> BuiltEngine:
    device = resolve_device(config.device)
    path = resolve_model_path(config.model, config.cache_dir)
    hf_config, _arch = load_config(path)
    tokenizer = load_tokenizer(path)
    model_max = max_model_len(hf_config)
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(f"max_model_len must be <= {model_max} for this model, got {config.max_model_len}")
    max_len = config.max_model_len or model_max
    eos = _eos_id(tokenizer, hf_config)
    vocab = int(hf_config.vocab_size)
    max_blocks_per_seq = -(-max_len // config.block_size)
    executor: Executor
    if device == "sim":
        from asyncbatch.executors.sim_executor import SimExecutor

        dtype = None
        num_blocks = choose_num_blocks(config, device, kv_bytes_per_token(hf_config, torch.bfloat16), max_len)
        executor = SimExecutor(config.sim, vocab, eos, config.max_num_seqs)
    else:
        from asyncbatch.executors.torch_executor import TorchExecutor

        if device == "cpu":
            # The device thread's kernels get every core; the planner and output threads mostly wait on it.
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        dtype = resolve_dtype(config.dtype, device)
        torch_device = torch.device(device)
        model = load_model(path, dtype, torch_device, max_positions=max_len)
        reserved = 0
        if device == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_gib is None:
            from asyncbatch.executors.cuda_memory import profile_step_memory

            reserved = profile_step_memory(model, config.max_num_seqs, config.max_num_batched_tokens,
                                           config.block_size, graphs=config.enable_cuda_graphs).reserve_bytes
        num_blocks = choose_num_blocks(config, device, kv_bytes_per_token(hf_config, dtype), max_len, reserved)
        kv_caches = model.new_kv_caches(num_blocks, config.block_size)
        if device == "cuda":
            from asyncbatch.executors.cuda_executor import CudaExecutor

            executor = CudaExecutor(model, kv_caches, config.max_num_seqs, torch_device,
                                    max_blocks_per_seq=max_blocks_per_seq,
                                    enable_cuda_graphs=config.enable_cuda_graphs,
                                    cuda_graph_batch_sizes=config.cuda_graph_batch_sizes)
        else:
            executor = TorchExecutor(model, kv_caches, config.max_num_seqs, torch_device)
    blocks = BlockManager(num_blocks, config.block_size)
    scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens)
    hidden = frozenset(t for t in (eos,) if t is not None)
    core = EngineCore(config, executor, scheduler, max_blocks_per_seq, eos, hidden)
    return BuiltEngine(core, path, hf_config, tokenizer, device, dtype, max_len, vocab, eos)
