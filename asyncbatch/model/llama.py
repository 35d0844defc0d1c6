"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Parameter names equal the Hugging Face ones, so a checkpoint's state dict
loads as it is. Qwen2 adds biases on q/k/v; Qwen3 adds per-head RMSNorm on q
and k before the rotation. Normalisation and rotation follow transformers'
arithmetic step for step (float32 variance, same cos/sin tables) so greedy
tokens agree with it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.host_zeros import host_zeros
from asyncbatch.model.lean_attention import decode_attention_kernel
from asyncbatch.model.lean_step import applies as lean_step_applies
from asyncbatch.model.lean_step import head_applies as lean_head_applies
from asyncbatch.model.lean_step import lean_layers, lean_logits
from asyncbatch.model.paged_attention import AttentionPlan, paged_attention, plan_attention
from asyncbatch.model.rope import RopeTables, apply_rope, rope_cos_sin, signed_sin, step_tables

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class StepContext(NamedTuple):
    """What every layer of one forward reads besides its own weights and cache, built once per forward."""

    batch: ForwardBatch
    rope: RopeTables
    attention: AttentionPlan | None  # the torch reference's masks and block lists; None on Triton
    fused: ModuleType | None = None  # ``fused_elementwise`` where the model runs its kernels (CUDA), else None


def rotate(x: torch.Tensor, step: StepContext) -> torch.Tensor:
    """``apply_rope`` with the step's tables: one fused kernel where the step has them."""
    if step.fused is not None:
        return step.fused.rope(x, step.rope.cos, step.rope.sin)
    return apply_rope(x, step.rope)


@functools.cache
def rms_norm_upcasts(dtype: torch.dtype) -> bool:
    """Whether the CPU ``torch.rms_norm`` of a ``dtype`` tensor is the float32 norm rounded once to ``dtype``
    (torch computes in float32 inside, eps included, in the versions measured): checked on probes of several
    widths (vector tails included) at three scales, the smallest where eps dominates, so a build that rounds
    otherwise keeps the explicit casts. A few milliseconds, once per process, at model load: never at import,
    because the engine's fork server imports this module, and a torch op there starts the OpenMP pool that
    its forked core processes would then deadlock on."""
    gen = torch.Generator().manual_seed(0)
    for width in (64, 576, 1000, 2048, 4096):
        for scale in (1e-3, 1.0, 300.0):
            x = (torch.randn(8, width, generator=gen) * scale).to(dtype)
            want = torch.rms_norm(x.float(), (width,), None, 1e-5).to(dtype)
            if not torch.equal(torch.rms_norm(x, (width,), None, 1e-5), want):
                return False
    return True


def use_direct_norms(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Let every ``RMSNorm`` of a loaded CPU model in ``dtype`` (bfloat16, float16) take its input as it is
    (``RMSNorm.direct``) where ``rms_norm_upcasts`` holds. Set once at load, so a compiled graph reads a
    constant attribute."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or not rms_norm_upcasts(dtype):
        return
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.direct = True


class RMSNorm(nn.Module):
    """transformers' RMSNorm, bit for bit: the variance in float32, the normalised value rounded to the
    input's dtype, then multiplied by the weight in that dtype.

    ``torch.rms_norm`` runs the same decomposition (pow, mean, add, rsqrt, mul) in C++ instead of eight
    Python-dispatched ops. In float32 it is the whole norm; in bfloat16 its fused weight product would
    round once where transformers rounds twice, so the weight is applied after the norm. ``direct`` (set at
    load on the CPU, ``use_direct_norms``): the bfloat16 norm takes the bfloat16 tensor as it is (torch
    computes it in float32 inside), two casts a norm fewer; otherwise it is given float32 and cast back.
    Checked equal element for element in ``tests/test_lean_step.py``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.direct = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The norm without the weight, in ``x``'s dtype (the caller multiplies by its weight)."""
        if x.dtype == torch.float32 or self.direct:
            return torch.rms_norm(x, self.weight.shape, None, self.eps)
        return torch.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        bias = arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden,
                                bias=bool(getattr(config, "attention_bias", False)) and arch != "Qwen2ForCausalLM")
        # Set by ``fused_projections.fuse_projections`` (at load): q, k and v as one linear (q_proj, k_proj,
        # v_proj removed).
        self.qkv_proj: nn.Module | None = None
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        h, kvh = self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(t, h + 2 * kvh, self.head_dim)  # [T, heads + 2 kv_heads, head_dim]
            # q and k side by side: normed and rotated together. ``split``: one op for the views, not one a view.
            qk, v = qkv.split((h + kvh, kvh), dim=1)
            if self.qk_norm:
                qk = self._qk_norm(qk)
            q, k = rotate(qk, step).split((h, kvh), dim=1)
        else:  # separate projections (``load_model(fuse=False)``: the fusion's reference)
            q = self.q_proj(x).view(t, h, self.head_dim)  # [T, heads, head_dim]
            k = self.k_proj(x).view(t, kvh, self.head_dim)  # [T, kv_heads, head_dim]
            v = self.v_proj(x).view(t, kvh, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate(q, step), rotate(k, step)
        out = paged_attention(q, k, v, k_cache, v_cache, step.batch, self.scale, step.attention)
        return self.o_proj(out.reshape(t, h * self.head_dim))

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head norms of q and k (``[T, heads + kv_heads, head_dim]``): one normalisation, then
        each part times its own weight, in place (the normalised tensor is new)."""
        h = self.num_heads
        qk = self.q_norm.normalize(qk)
        qk[:, :h].mul_(self.q_norm.weight)
        qk[:, h:].mul_(self.k_norm.weight)
        return qk


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        # Set by ``fused_projections.fuse_projections`` for quantized and packed bfloat16 weights (gate_proj,
        # up_proj removed).
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        """``fused``: ``fused_elementwise``, whose one kernel gives ``F.silu(gate) * up``."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # views of one [T, 2 * intermediate] product
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up if fused is None else fused.silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: str) -> None:
        super().__init__()
        self.self_attn = Attention(config, arch)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, arch) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """One class for the four architectures; ``arch`` selects biases and q/k norms."""

    def __init__(self, config: PretrainedConfig, arch: str, max_positions: int) -> None:
        super().__init__()
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
        self.config = config
        self.arch = arch
        self.model = Backbone(config, arch)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Set by ``quantization.quantize_model``: the weight precision and the LM head that replaces
        # ``output_weight``.
        self.quantization: str | None = None
        self.quantized_lm_head: nn.Module | None = None
        # Set by ``emulated_bf16.emulate_bf16_linears``: bfloat16 on a CPU without bfloat16 kernels.
        self.emulated_lm_head: nn.Module | None = None
        # Set by ``packed_linears.pack_linears``: bfloat16 on a CPU with bfloat16 kernels (small steps), float32 on AMD.
        self.packed_lm_head: nn.Module | None = None
        # Set by ``fused_elementwise.enable`` (the CUDA executor, where ``ASYNCBATCH_FUSED_ELEMENTWISE=1``): that
        # module, whose kernels replace the norms, residual adds, rotary and SiLU x up of every layer.
        self.fused_elementwise: ModuleType | None = None
        # Set by ``loader.load_model`` (``lean_step.lean_library``): ``lean_cpu.c``'s kernels, which run the CPU's
        # small decode steps between the products (``lean_step``), or None.
        self.lean_kernels: object | None = None
        self.lean_plan: list | None = None  # ``lean_step.layer_plan``: its layers as the lean step reads them
        self.lean_head: Callable | None = None  # ``lean_step.lean_logits``: the LM head's product by the kernels
        # Set by ``loader.load_model``: whether the lean step multiplies by the kernels' own product where a weight
        # is plain (``ASYNCBATCH_CPU_LEAN_PRODUCTS``, read once there; the weights were kept for it accordingly).
        self.lean_products = False
        self.lean_max_rows = 0  # set by ``loader.load_model`` (``lean_step.lean_max_rows``): the lean step's rows
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        cos, sin = rope_cos_sin(config, attn.head_dim, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("rope_sin_signed", signed_sin(sin), persistent=False)

    @property
    def lm_head_reads_embedding(self) -> bool:
        """Whether the LM head multiplies by the (tied) embedding table, reading all of it every step."""
        return self.tie_word_embeddings and self.quantized_lm_head is None and self.emulated_lm_head is None

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def new_kv_caches(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed key and value caches for every layer, ``[num_blocks, block_size, kv_heads, head_dim]`` each
        (``paged_attention``'s layout), in the weights' dtype and on their device; separate tensors (compiled
        steps write them in place, which aliased views of one buffer would complicate). On the CPU they are
        ``calloc``'d (``host_zeros``): pages are zeroed by the kernel when a step first writes them."""
        weight = self.model.embed_tokens.weight
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        if weight.device.type == "cpu":
            def zeros() -> torch.Tensor:
                return host_zeros(shape, weight.dtype)
        else:
            def zeros() -> torch.Tensor:
                return weight.new_zeros(shape)
        return [(zeros(), zeros()) for _ in self.model.layers]

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Returns logits ``[R, vocab]`` in float32 for ``batch.logits_indices``."""
        return self.compute_logits(self.hidden_states(batch, kv_caches))

    def hidden_states(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The final-normed hidden states ``[R, hidden]`` of ``batch.logits_indices``: ``forward`` without the
        LM head (a CUDA graph of a step whose sampling runs outside it stops here)."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        # What every layer shares is computed once here: the rotary rows and (below) the attention's masks and
        # block lists (``paged_attention.plan_attention``; None on Triton).
        rope = step_tables(self.rope_cos, self.rope_sin_signed, batch.positions, x.dtype)
        if self.lean_kernels is not None and lean_step_applies(batch, self.lean_max_rows):
            x = lean_layers(self, self.lean_kernels, x, batch, kv_caches, rope)
            return self.model.norm(x[batch.logits_indices])  # [R, hidden]
        attention = plan_attention(batch, kv_caches[0][0].shape[1], x.device, x.dtype)
        if attention is not None and self.lean_kernels is not None:  # the decode rows attend in place
            attention.decode = decode_attention_kernel(self.lean_kernels, batch, kv_caches, x.dtype)
        step = StepContext(batch, rope, attention, self.fused_elementwise)
        if step.fused is not None:
            x = self._fused_layers(x, step, kv_caches)
        else:
            for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
                x = layer(x, step, k_cache, v_cache)
        return self.model.norm(x[batch.logits_indices])  # [R, hidden]

    def _fused_layers(self, x: torch.Tensor, step: StepContext,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Every ``DecoderLayer`` with ``fused_elementwise``'s kernels: each residual sum is computed with the
        norm that follows it (the next layer's input norm included) in one kernel; the last sum stays a plain
        add, since the final norm reads only the rows whose logits are wanted."""
        ops, layers = step.fused, self.model.layers
        norm = layers[0].input_layernorm
        h, residual = ops.add_rms_norm(x, None, norm.weight, norm.eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches)):
            attn = layer.self_attn(h, step, k_cache, v_cache)
            norm = layer.post_attention_layernorm
            h, residual = ops.add_rms_norm(attn, residual, norm.weight, norm.eps)
            mlp = layer.mlp(h, ops)
            if i + 1 == len(layers):
                return residual + mlp
            norm = layers[i + 1].input_layernorm
            h, residual = ops.add_rms_norm(mlp, residual, norm.weight, norm.eps)
        return x  # no layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: ``[R, hidden]`` final-normed states → ``[R, vocab]`` float32 logits."""
        if self.quantized_lm_head is not None:
            return self.quantized_lm_head(hidden).float()
        if self.emulated_lm_head is not None:
            return self.emulated_lm_head(hidden)
        if lean_head_applies(self, hidden):
            return lean_logits(self, hidden)
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden, self.output_weight).float()
        return F.linear(hidden, self.output_weight).float()
