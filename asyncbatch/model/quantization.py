"""Int8 / int4 weights on the CPU: the ``quantization=`` engine argument, applied as a module swap after loading.

Every projection of the decoder layers (q/k/v and gate/up fused into one linear each by
``fused_projections``, o, down) and the LM head is replaced by a ``QuantizedLinear`` holding its weight in one of these
forms (the embedding table stays in the model's dtype: a lookup reads only the
step's rows of it; with tied embeddings the LM head gets its own quantized copy):

``int8``  weight-only: int8 per output channel (symmetric, scale = max|w| / 127),
          torch's packed kernel ``aten._weight_int8pack_mm`` on bfloat16 activations at
          every row count. (A float path for many rows, dequantizing each weight to
          float32 per call, was measured and dropped: on AVX2 the packed kernel falls
          behind float32 beyond ~8 rows, but dequantizing moves 5 bytes per weight
          through memory and made a 32-row step 1.4x slower still; docs/cpu-precision.md.)
``int4``  weight-only: 4-bit codes with a scale and zero point per group of
          ``INT4_GROUP_SIZE`` inputs (asymmetric, min/max), torch's packed CPU kernel
          ``aten._weight_int4pack_mm_for_cpu`` on bfloat16 activations at every row count
          (its packed layout cannot be dequantized cheaply, so there is no float path for
          many rows). The LM head is ``int8``, as GGUF files keep it: the default model's
          layers are Q4_1 (4-bit, groups of 32, scale and minimum: the grid above) and its
          embedding Q8_0, and an int4 head cost 13 points of top-1 agreement.
``w8a8``  int8 weights per output channel and int8 activations quantized per row
          at each call (dynamic), multiplied in integers by fbgemm (``quantized::linear_dynamic``,
          AVX2 u8 x s8 dot products). fbgemm quantizes its input with one scale for the
          whole batch; each row is first divided by its own max|x| and a sentinel row
          pins the batch's range to [-1, 1], so every row gets its own 7-bit grid
          (fbgemm's ``reduce_range``) and its result does not depend on the other rows.
          A few input channels carry most of the activations' range (outliers), so
          inputs are smoothed first (SmoothQuant, Xiao et al. 2023): channel ``j`` is
          divided by ``s_j = sqrt(max|x_j| / max|W[:, j]|)`` and the weight's column
          multiplied by it, ``max|x_j|`` measured once at load on ``data/calibration_text.txt``
          (~500 tokens of prose shipped for this; seeded random token ids where the
          model has no tokenizer). Measured on SmolLM2-135M: top-1 agreement with
          float32 78.5 % without smoothing, 88.4 % with it.

A row's result depends only on that row, whatever else is in the batch. Private aten ops are checked before use:
an unsupported combination is a ``ValueError`` naming ``quantization``.
"""

from __future__ import annotations

import os
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from asyncbatch.config import QUANTIZATIONS
from asyncbatch.model.fused_projections import ALL_GROUPS, fuse_projections

INT4_GROUP_SIZE = 32
W8A8_REDUCE_RANGE = True
CALIBRATION_TEXT = Path(__file__).resolve().parent / "data" / "calibration_text.txt"


# fbgemm's packed weights are a TorchScript object, which torch.compile cannot pass into a graph. The compiled
# decode path (``compiled_decode``) calls ``asyncbatch::w8a8_linear`` instead: the same op, its weight named by
# an int handle into this registry (an entry lives as long as its ``QuantizedLinear``). A compiled graph bakes
# the handles in as constants, so a new linear takes the smallest free handle: a model built after an earlier
# one was freed gets the same handles layer for layer, its graphs equal the earlier ones, and inductor's
# on-disk cache serves them (~5 s) instead of a fresh C++ compile (~45 s on 2 cores).
_W8A8_PACKED: dict[int, tuple[object, int]] = {}  # handle -> (packed weight, out_features)


def _free_w8a8_handle() -> int:
    """The smallest int no live ``w8a8`` linear holds."""
    handle = 0
    while handle in _W8A8_PACKED:
        handle += 1
    return handle


# A plain ``torch.library`` op with a CPU kernel: ~40 us less per call than ``torch.library.custom_op``'s wrapper
# (measured 118 vs 164 us per call of a 576 x 1536 layer at 2 rows, direct fbgemm 81 us; 121 calls a step).
_LIB = torch.library.Library("asyncbatch", "FRAGMENT")  # kv_write_op adds to the namespace too
_LIB.define("w8a8_linear(Tensor x, int handle) -> Tensor")


def _w8a8_linear_cpu(x: torch.Tensor, handle: int) -> torch.Tensor:
    """``quantized::linear_dynamic`` (7-bit range) of ``x [R, K]`` float32 by the packed weight ``handle``."""
    return torch.ops.quantized.linear_dynamic(x, _W8A8_PACKED[handle][0], W8A8_REDUCE_RANGE)


_LIB.impl("w8a8_linear", _w8a8_linear_cpu, "CPU")


@torch.library.register_fake("asyncbatch::w8a8_linear")
def _w8a8_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _W8A8_PACKED[handle][1])


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def _fbgemm_available() -> bool:
    engines = torch.backends.quantized.supported_engines
    return ("fbgemm" in engines or "x86" in engines) and hasattr(torch.ops.quantized, "linear_dynamic")


def unavailable_reason(name: str) -> str | None:
    """Why this torch build cannot run ``quantization=name`` on the CPU, or None when it can."""
    if name == "int8" and not _has_op("_weight_int8pack_mm"):
        return f"torch {torch.__version__} has no aten._weight_int8pack_mm"
    if name == "int4" and not (_has_op("_weight_int4pack_mm_for_cpu")
                               and _has_op("_convert_weight_to_int4pack_for_cpu")):
        return f"torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu (needs torch >= 2.5)"
    if name == "w8a8" and not _fbgemm_available():
        return (f"torch {torch.__version__} on this CPU has no fbgemm quantized engine "
                f"(supported: {torch.backends.quantized.supported_engines})")
    return None


def check_quantization(name: str | None, device: str, dtype: torch.dtype | None = None) -> None:
    """``ValueError`` naming ``quantization`` when ``name`` cannot run with this device and dtype."""
    if name is None:
        return
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZATIONS)}, got {name!r}")
    if device != "cpu":
        raise ValueError(f"quantization={name!r} runs on the cpu device only (torch's packed CPU kernels), "
                         f"got device={device!r}; use quantization=None there")
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantization={name!r} needs dtype float32 or bfloat16 activations, got {dtype}")
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(f"quantization={name!r} is not available: {reason}")


def _bf16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 values >= ``x`` (> 0), back in float32: scales the bfloat16 kernels hold exactly."""
    y = x.to(torch.bfloat16).float()
    return torch.where(y < x, torch.nextafter(y.to(torch.bfloat16), torch.tensor(float("inf"),
                                                                                 dtype=torch.bfloat16)).float(), y)


def _int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(codes [N, K] int8, scales [N] float32)``. Scales are bfloat16
    values (the packed kernel reads them in bfloat16), so rounding them adds no error of its own."""
    w = weight.detach().float()
    scales = _bf16_up((w.abs().amax(dim=1) / 127.0).clamp(min=1e-30))  # [N]
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    return codes, scales


def _int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of ``group`` inputs: ``(codes [N, K] int32 in 0..15,
    scale_and_zero [K / group, N, 2] float32)`` in the layout of ``_weight_int4pack_mm_for_cpu``, which
    dequantizes ``(code - 8) * scale + zero``."""
    w = weight.detach().float()
    n, k = w.shape
    wg = w.view(n, k // group, group)  # [N, groups, group]
    low, high = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, groups]
    # Scale and zero point as the kernel holds them (bfloat16); codes are chosen against those.
    scale = _bf16_up(((high - low) / 15.0).clamp(min=1e-30))
    zero = (low + 8.0 * scale).to(torch.bfloat16).float()
    codes = torch.round((wg - zero[..., None]) / scale[..., None] + 8.0).clamp(0, 15)
    codes = codes.to(torch.int32).view(n, k)
    return codes, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in int8 or int4 (see the module docstring); ``x`` and ``y`` keep the
    caller's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str,
                 input_absmax: torch.Tensor | None = None) -> None:
        super().__init__()
        if scheme not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {scheme!r}")
        self.scheme = scheme
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        if scheme == "int8":
            codes, scales = _int8_per_channel(weight)
            self.register_buffer("codes", codes)  # [N, K] int8
            self.register_buffer("scales_bf16", scales.to(torch.bfloat16))  # [N], exact (see _int8_per_channel)
        elif scheme == "int4":
            if self.in_features % INT4_GROUP_SIZE:
                raise ValueError(f"quantization='int4' needs in_features divisible by {INT4_GROUP_SIZE}, "
                                 f"got a {self.in_features}-input linear")
            pad = -self.out_features % 16  # the packing takes output rows in multiples of 16
            codes, scale_zero = _int4_groups(F.pad(weight.detach().float(), (0, 0, 0, pad)), INT4_GROUP_SIZE)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            self.register_buffer("scale_zero", scale_zero.to(torch.bfloat16))  # [K / group, N, 2]
        else:
            smooth = _smoothing(weight, input_absmax)  # [K]
            self.inv_smooth: torch.Tensor | None = (1.0 / smooth).float()  # None once folded into a norm
            codes, scales = _int8_per_channel(weight.detach().float() * smooth[None, :])
            with warnings.catch_warnings():  # quantized tensors are deprecated (torch 2.10+), still supported
                warnings.simplefilter("ignore", UserWarning)
                qweight = torch.quantize_per_channel(codes.float() * scales[:, None], scales.double(),
                                                     torch.zeros_like(scales, dtype=torch.int64), 0, torch.qint8)
            # A packed fbgemm handle is not a tensor: kept as an attribute, counted by ``nbytes``.
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
            self._handle = _free_w8a8_handle()
            _W8A8_PACKED[self._handle] = (self._packed, self.out_features)
            weakref.finalize(self, _W8A8_PACKED.pop, self._handle, None)
            self._packed_bytes = codes.numel() + 4 * scales.numel()
            self.register_buffer("sentinel", torch.zeros(1, self.in_features))
            self.sentinel[0, 0], self.sentinel[0, -1] = 1.0, -1.0  # pins the batch's range to [-1, 1]

    @property
    def nbytes(self) -> int:
        """Bytes of the weight in its stored form (what a call reads), bias included."""
        total = sum(b.numel() * b.element_size() for b in self.buffers() if b is not getattr(self, "sentinel", None))
        total += getattr(self, "_packed_bytes", 0)
        if self.bias is not None:
            total += self.bias.numel() * 4
        return total

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features)  # [R, K]
        rows = x2.shape[0]
        if self.scheme == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.codes, self.scales_bf16)
        elif self.scheme == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.packed,
                                                           INT4_GROUP_SIZE, self.scale_zero)
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features]
        else:
            xf = x2.float()
            if self.inv_smooth is not None:
                xf = xf * self.inv_smooth
            row_max = torch.linalg.vector_norm(xf, float("inf"), dim=1, keepdim=True).clamp_(min=1e-12)  # [R, 1]
            scaled = torch.cat((xf / row_max, self.sentinel))  # [R + 1, K], every row within [-1, 1]
            if torch.compiler.is_compiling():
                y = torch.ops.asyncbatch.w8a8_linear(scaled, self._handle)
            else:
                y = torch.ops.quantized.linear_dynamic(scaled, self._packed, W8A8_REDUCE_RANGE)
            y = y[:rows] * row_max
        if self.bias is not None:
            y = y.float() + self.bias
        return y.to(dtype).reshape(*shape[:-1], self.out_features)


def _smoothing(weight: torch.Tensor, input_absmax: torch.Tensor | None) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors (alpha 0.5); ones without activation statistics."""
    w = weight.detach().float()
    if input_absmax is None:
        return torch.ones(w.shape[1])
    w_max = w.abs().amax(dim=0).clamp(min=1e-8)  # [K]
    return (input_absmax.float().clamp(min=1e-5).sqrt() / w_max.sqrt()).clamp(min=1e-5)


def calibration_ids(model_path: str | os.PathLike[str] | None, vocab_size: int, n: int = 512) -> list[int]:
    """Token ids of ``data/calibration_text.txt`` in the model's tokenizer, or seeded random ids without one."""
    if model_path is not None:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
            ids = tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:n]
            if ids and max(ids) < vocab_size:
                return ids
        except (OSError, ValueError):
            pass
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (n,), generator=gen).tolist()


def input_absmax(model: nn.Module, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """max|x| per input channel of every projection and of the LM head, over one prefill of ``token_ids``."""
    from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow

    stats: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        a = x.detach().float().abs().reshape(-1, x.shape[-1]).amax(dim=0)
        stats[name] = torch.maximum(stats[name], a) if name in stats else a

    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: record(name, args[0]))
             for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    hooks.append(model.model.norm.register_forward_hook(lambda mod, args, out: record("lm_head", out)))
    block = 16
    n = len(token_ids)
    blocks = -(-n // block)
    table = torch.arange(1, blocks + 1, dtype=torch.int64)
    positions = torch.arange(n, dtype=torch.int64)
    batch = ForwardBatch(input_ids=torch.tensor(token_ids, dtype=torch.int64), positions=positions,
                         slot_mapping=table[positions // block] * block + positions % block, num_decode=0,
                         decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
                         decode_context_lens=torch.zeros(0, dtype=torch.int64),
                         prefill_rows=[PrefillRow(0, n, n, table)], logits_indices=torch.arange(n))
    try:
        with torch.inference_mode():
            model(batch, model.new_kv_caches(blocks + 1, block))
    finally:
        for h in hooks:
            h.remove()
    return stats


def quantize_model(model: nn.Module, scheme: str, model_path: str | os.PathLike[str] | None = None) -> nn.Module:
    """Swap the decoder layers' projections and the LM head of a loaded ``CausalLM`` for ``QuantizedLinear``
    (in place; returns the model). ``w8a8`` first measures the inputs' ranges on the calibration text
    (tokenized with the tokenizer in ``model_path``, if any)."""
    check_quantization(scheme, "cpu")
    fuse_projections(model, ALL_GROUPS)  # q/k/v are fused at load already; gate/up are fused here
    stats: dict[str, torch.Tensor] = {}
    if scheme == "w8a8":
        n = min(512, int(model.rope_cos.shape[0]))
        stats = input_absmax(model, calibration_ids(model_path, int(model.config.vocab_size), n))
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        where = f"model.layers.{i}"
        # q/k/v and gate/up are one linear each (``fused_projections``): one packed-kernel call instead of three and
        # two; per-output-row scales make a quantized fused linear the same arithmetic as separate ones.
        for parent, name, part in ((attn, "qkv_proj", "self_attn"), (attn, "o_proj", "self_attn"),
                                   (mlp, "gate_up_proj", "mlp"), (mlp, "down_proj", "mlp")):
            linear = getattr(parent, name)
            setattr(parent, name, QuantizedLinear(linear.weight, linear.bias, scheme,
                                                  stats.get(f"{where}.{part}.{name}")))
        # The fused linears' inputs are RMSNorm outputs: their smoothing divides the norms' weights instead.
        _fold_smoothing(attn.qkv_proj, layer.input_layernorm)
        _fold_smoothing(mlp.gate_up_proj, layer.post_attention_layernorm)
    head_scheme = "int8" if scheme == "int4" else scheme
    model.quantized_lm_head = QuantizedLinear(model.output_weight, None, head_scheme, stats.get("lm_head"))
    if not model.tie_word_embeddings:
        del model.lm_head  # its float weight is no longer read
    model.quantization = scheme
    return model


def _fold_smoothing(linear: QuantizedLinear, norm: nn.Module) -> None:
    inv = getattr(linear, "inv_smooth", None)
    if inv is not None:
        with torch.no_grad():
            norm.weight.mul_(inv.to(norm.weight.dtype))
        linear.inv_smooth = None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight a forward reads in full (the embedding table counts when the LM head reads it)."""
    total, seen = 0, set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rope_") or name.endswith("sentinel") or t.data_ptr() in seen:
            continue
        if name == "model.embed_tokens.weight" and not model.lm_head_reads_embedding:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total + packed_bytes(model)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the weights held as fbgemm packed handles (``w8a8``): no tensors, so no buffer counts them."""
    return sum(getattr(m, "_packed_bytes", 0) for m in model.modules())
