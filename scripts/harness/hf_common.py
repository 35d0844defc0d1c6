"""What the transformers baselines share: the same weights, dtype, device and sampling as asyncbatch.

The model is loaded from the directory asyncbatch itself loads (the converted
safetensors of the default GGUF, or the given checkpoint), in the dtype
asyncbatch resolves for the device, so every system multiplies the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from asyncbatch.config import EngineConfig
from asyncbatch.engine.builder import choose_num_blocks, kv_bytes_per_token, resolve_device
from asyncbatch.model.loader import load_tokenizer, max_model_len, resolve_dtype, resolve_model_path
from harness.memory import module_mib
from harness.system_base import BenchSettings


@dataclass(slots=True)
class HFModel:
    model: PreTrainedModel
    device: torch.device
    dtype: torch.dtype
    eos_token_id: int | None
    pad_token_id: int
    load_mib: float  # weights and buffers
    kv_capacity_tokens: int  # what asyncbatch's KV cache holds with the same settings


def kv_capacity_tokens(settings: BenchSettings, model: PreTrainedModel, dtype: torch.dtype, device: str) -> int:
    """Tokens of KV cache asyncbatch allocates for these settings, so baselines get the same capacity."""
    config = EngineConfig(model=settings.model, device=device, dtype=settings.dtype,
                          max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens)
    blocks = choose_num_blocks(config, device, kv_bytes_per_token(model.config, dtype), max_model_len(model.config))
    return (blocks - 1) * config.block_size  # block 0 is asyncbatch's dummy block


def load_hf_model(settings: BenchSettings) -> HFModel:
    device_name = resolve_device(settings.device)
    if device_name == "sim":
        raise ValueError("the transformers baselines need a real device (cpu or cuda), not 'sim'")
    device = torch.device(device_name)
    dtype = resolve_dtype(settings.dtype, device)
    path = resolve_model_path(settings.model)
    hf_logging.disable_progress_bar()  # the benchmark's own bar is the one to watch
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    load_mib = module_mib(model)
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    tokenizer = load_tokenizer(path)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos if eos is not None else 0
    capacity = kv_capacity_tokens(settings, model, dtype, device_name)
    return HFModel(model, device, dtype, eos, int(pad), load_mib, capacity)


def generation_config(settings: BenchSettings, hf: HFModel, max_new_tokens: int | None = None) -> GenerationConfig:
    """Greedy (or plain temperature sampling: no top-k/top-p) with EOS disabled under ``ignore_eos``."""
    kwargs: dict = {"max_new_tokens": max_new_tokens, "pad_token_id": hf.pad_token_id,
                    "eos_token_id": None if settings.ignore_eos else hf.eos_token_id}
    if settings.temperature > 0:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    return GenerationConfig(**kwargs)


def effective_eos(settings: BenchSettings, hf: HFModel) -> int:
    """The EOS id for continuous batching's ``add_request``: -1 never matches, i.e. ignore EOS."""
    if settings.ignore_eos or hf.eos_token_id is None:
        return -1
    return int(hf.eos_token_id)


def cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    """Tokens up to and including the first EOS (what a request outputs when EOS is honoured)."""
    if eos is None or eos not in tokens:
        return tokens
    return tokens[:tokens.index(eos) + 1]
