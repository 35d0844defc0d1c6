"""Tiny random transformers checkpoints for tests, written with ``save_pretrained``.

Every model has hidden size 64, 2 layers, 4 attention heads over 2 KV heads of
dimension 16 and a 300-token vocabulary; building and saving one takes a few
tens of milliseconds. The directory also gets a byte-level tokenizer whose ids
fit the vocabulary (ids 0-2 are ``<unk> <s> </s>``, then the 256 bytes), so
engine tests can run text end to end.

Weights are seeded, and the RMSNorm weights and linear biases that transformers
initialises to constants are randomised too: otherwise a wrong bias or q/k
norm would go unnoticed by a comparison against transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

TINY_VOCAB = 300
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
BOS_ID, EOS_ID = 1, 2
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "LlamaForCausalLM": LlamaConfig,
    "MistralForCausalLM": MistralConfig,
    "Qwen2ForCausalLM": Qwen2Config,
    "Qwen3ForCausalLM": Qwen3Config,
}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}


def tiny_config(arch: str, *, tie_word_embeddings: bool = False, rope_parameters: dict | None = None,
                **overrides: object) -> PretrainedConfig:
    """Config of a tiny ``arch`` model; ``overrides`` replace any field."""
    if arch not in CONFIG_CLASSES:
        raise ValueError(f"arch must be one of {list(CONFIG_CLASSES)}, got {arch!r}")
    fields: dict[str, object] = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": TINY_VOCAB, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "initializer_range": 0.1, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "tie_word_embeddings": tie_word_embeddings,
    }
    if rope_parameters is not None:
        fields["rope_parameters"] = dict(rope_parameters)
    fields.update(overrides)
    config = CONFIG_CLASSES[arch](**fields)
    config.architectures = [arch]
    return config


def build_tiny_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """A float32 eval-mode transformers model with every parameter random."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
    return model.eval()


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: one id per byte, 259 ids in all."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS[0]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=SPECIAL_TOKENS[0],
                                   bos_token=SPECIAL_TOKENS[BOS_ID], eos_token=SPECIAL_TOKENS[EOS_ID])


def save_tiny_model(directory: str | Path, arch: str, *, tie_word_embeddings: bool = False,
                    rope_parameters: dict | None = None, max_shard_size: str | None = None, seed: int = 0,
                    with_tokenizer: bool = True, **overrides: object) -> Path:
    """Save a tiny random ``arch`` model (and tokenizer) into ``directory`` and return it.

    ``max_shard_size`` (e.g. ``"100KB"``) makes a sharded checkpoint with a
    ``model.safetensors.index.json``.
    """
    directory = Path(directory)
    config = tiny_config(arch, tie_word_embeddings=tie_word_embeddings, rope_parameters=rope_parameters,
                         **overrides)
    model = build_tiny_model(config, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    if with_tokenizer:
        build_byte_tokenizer().save_pretrained(directory)
    return directory
