"""CPU linears on oneDNN's packed weight layout: bfloat16 where the CPU has bfloat16 dot products, float32 on AMD.

torch's ``F.linear`` hands a plain row-major weight to its BLAS: oneDNN for bfloat16, which reorders it into
its blocked layout inside every call, and MKL for float32. Packing each weight once at load
(``mkldnn._reorder_linear_weight``) and calling the packed product (``mkldnn._linear_pointwise``) skips the
reorder, and for float32 on AMD CPUs replaces a slow library path.

**bfloat16.** Measured on a 2-core Xeon with AMX, 2 threads, SmolLM2-135M's 150 decoder linears
(``profiles/cpu-kernel-threads-intel-xeon-2core``): 20.0 -> 13.4 ms at one row, 19.8 -> 14.0 at 8, 22.9 ->
17.3 at 32, 40.5 -> 32.7 at 128, 126 -> 81 at 512. Up to 32 rows the outputs are bit-identical to
``F.linear``'s; above, they differ in bfloat16 rounding (another blocking of the float32 sums), enough to move
greedy tokens at near-ties after a prefill. So the packed product serves steps of at most
``PACKED_MAX_ROWS`` rows (decode steps of small batches, where the step is weight reads), and larger ones
(prefill chunks, large batches) keep ``F.linear`` on the plain weight: the same numbers as before, at the cost
of holding each decoder weight twice (the packed copy is not a parameter). Not on a CPU that emulates
bfloat16 (``emulated_bf16``). ``ASYNCBATCH_BF16_PACKED=0`` keeps ``F.linear`` everywhere (to compare).

**float32, on AMD CPUs.** There MKL's float32 product of one row reads SmolLM2's weights at 10-16 GB/s where
oneDNN's packed one reads 15-30 GB/s and a ``sum()`` 33-35 (2-core AMD EPYC, Zen 4, 2 threads), and oneDNN is
1.06-1.6x faster at 64-1,024 rows too; a whole one-row decode step of SmolLM2-135M went 64 -> 48 ms
(``profiles/packed-float32-amd-epyc-2core``). So every float32 decoder linear multiplies through its packed copy
at every step size. Its plain weight is dropped (the packed copy's bytes are counted instead, ``_packed_bytes``)
unless the model takes the lean CPU step, whose small steps (``lean_step.lean_max_rows``) multiply by the plain
weights faster still (``lean_step``; up to ``LEAN_PLAIN_MAX_BYTES`` of them are kept for it beside the packed
copies). The sums come out in another order than MKL's, so the last bits of a logit differ; neither library
gives a row the same bits in a batch of one and of two, so no invariant is lost. On Intel CPUs MKL's float32
path is Intel's own and the packed one is unmeasured: off there unless ``ASYNCBATCH_F32_PACKED=1``; ``=0`` turns
it off on AMD.

The LM head gets a packed copy of its weight in both dtypes (``PackedHead``; the model's own weight stays, for
the tied embedding's lookup): SmolLM2's 49,152 x 576 bfloat16 head at one row, 2 threads, 2.54 -> 1.27 ms,
bit-identical. Never with ``compile_decode`` (the compiler does not trace opaque oneDNN tensors), nor where
oneDNN is missing.

**bfloat16 steps of one or two rows** can go through a third copy, fbgemm's float16 one (``fp16_kernel``), which
reads the weights faster than oneDNN at those sizes on the CPUs where it was measured; models that take the lean
CPU step multiply those steps by their plain weights instead (``lean_step``) and hold no such copy.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn

from asyncbatch.model.cpu_features import cpu_vendor
from asyncbatch.model.emulated_bf16 import swap_decoder_linears
from asyncbatch.model.fp16_kernel import FP16_KERNEL_MAX_ROWS, fp16_product, pack_fp16, wants_fp16_kernel

BF16_PACKED_ENV = "ASYNCBATCH_BF16_PACKED"
F32_PACKED_ENV = "ASYNCBATCH_F32_PACKED"
PACKED_MAX_ROWS = 32  # bfloat16: the most rows measured bit-identical to F.linear (module docstring)
# float32: the plain weights held beside the packed copies for the lean CPU step without being asked (models up to
# ~250M parameters; SmolLM2-135M's decoder holds 428 MB).
LEAN_PLAIN_MAX_BYTES = 1 << 30
# CPUs whose float32 products go through the packed copy unless ASYNCBATCH_F32_PACKED says otherwise.
F32_PACKED_VENDORS = ("AuthenticAMD",)
logger = logging.getLogger(__name__)


def packs_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a ``dtype`` model on ``device`` gets ``PackedLinear`` (the caller rules out emulated bfloat16 and
    quantized weights)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return os.environ.get(BF16_PACKED_ENV) != "0" and _packed_product_works(dtype)
    if dtype == torch.float32:
        asked = os.environ.get(F32_PACKED_ENV)
        wanted = asked == "1" if asked in ("0", "1") else cpu_vendor() in F32_PACKED_VENDORS
        return wanted and _packed_product_works(dtype)
    return False


@functools.cache
def _packed_product_works(dtype: torch.dtype) -> bool:
    """One small packed product that gives ``F.linear``'s (bit for bit in bfloat16, within float32 rounding):
    the ops are internal to torch, so a build without them, or one where they changed, keeps the plain path."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 32, generator=gen).to(dtype)
    x = torch.randn(2, 32, generator=gen).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out = _packed_product(x, packed, None)
    except (RuntimeError, AttributeError):
        return False
    want = nn.functional.linear(x, weight)
    return torch.equal(out, want) if dtype == torch.bfloat16 else torch.allclose(out, want, rtol=1e-5, atol=1e-5)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """``nn.Linear`` multiplying through a copy of its weight packed for oneDNN (an opaque tensor held as a
    plain attribute), for steps of at most ``max_rows`` rows (None: every step).

    With a ``max_rows`` (bfloat16), larger steps use ``F.linear`` on ``weight``, the parameter kept for them;
    a step reads the weight either way, so ``weight_bytes`` counts it once. Without one (float32), there is no
    plain ``weight`` unless ``keep_weight`` (the lean CPU step multiplies its small steps by it, ``lean_step``):
    else ``_packed_bytes`` says what the packed copy holds."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int | None,
                 keep_weight: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        keep = max_rows is not None or keep_weight
        self.weight = nn.Parameter(weight.detach(), requires_grad=False) if keep else None
        if not keep:
            self._packed_bytes = weight.numel() * weight.element_size()
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # A fused group (gate/up): the output sizes of its parts, multiplied apart above ``max_rows`` so that
        # large steps keep the separate linears' numbers (``pack_linears``); None: one product.
        self.splits: tuple[int, ...] | None = None
        # bfloat16: fbgemm's float16 copy for steps of at most FP16_KERNEL_MAX_ROWS rows (``fp16_kernel``), or None.
        self.fp16: torch.ScriptObject | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's activations are [T, hidden]: no reshape and view back (two ops a linear)
            return self._forward_2d(x)
        return self._forward_2d(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def _forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp16 is not None and x.shape[0] <= FP16_KERNEL_MAX_ROWS:
            return fp16_product(x, self.fp16)
        if self.max_rows is None or x.shape[0] <= self.max_rows:
            return _packed_product(x, self.packed, self.bias)
        if self.splits is None:
            return nn.functional.linear(x, self.weight, self.bias)
        weights = self.weight.split(self.splits)
        biases = (None,) * len(weights) if self.bias is None else self.bias.split(self.splits)
        return torch.cat([nn.functional.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


class PackedHead(nn.Module):
    """The LM head's product through a packed copy of the model's ``output_weight`` for at most ``max_rows``
    rows (None: every step), ``F.linear`` on the plain weight above. It holds only the packed copy (an opaque
    attribute, not a parameter): the plain weight stays the model's (the tied embedding table, or ``lm_head``)
    and is passed in, so the weight is counted, moved and saved once."""

    def __init__(self, weight: torch.Tensor, max_rows: int | None) -> None:
        super().__init__()
        self.max_rows = max_rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.fp16: torch.ScriptObject | None = None  # as ``PackedLinear.fp16``

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> ``[R, vocab]`` in the weight's dtype (``weight``: the plain ``output_weight``)."""
        if self.fp16 is not None and hidden.shape[0] <= FP16_KERNEL_MAX_ROWS:
            return fp16_product(hidden, self.fp16)
        if self.max_rows is not None and hidden.shape[0] > self.max_rows:
            return nn.functional.linear(hidden, weight)
        return _packed_product(hidden, self.packed, None)


def pack_linears(model: nn.Module, lean_step: bool = False) -> int:
    """Swap every ``nn.Linear`` of a loaded ``CausalLM``'s decoder for ``PackedLinear`` and give its LM head a
    ``PackedHead`` (in place); returns how many linears were swapped. bfloat16 weights are packed for steps of
    at most ``PACKED_MAX_ROWS`` rows, float32 ones for every step (the module docstring says why).

    A fused gate/up (``loader.load_model`` fuses it for packing) is one packed product, bit-identical in
    bfloat16 to the two separate ones (oneDNN computes each output from the same dot product; checked at 1, 8
    and 32 rows) and one call fewer a layer (SmolLM2 at one row: 78 -> 65 us for gate, up and the activation);
    above ``PACKED_MAX_ROWS`` its halves are multiplied apart: ``F.linear`` on the fused weight rounds
    differently at 2,048 rows, and large steps keep the separate linears' numbers.

    bfloat16 linears and the head also get fbgemm's float16 copy for steps of one or two rows where
    ``fp16_kernel.wants_fp16_kernel`` says so. ``lean_step``: the model will take the lean CPU step, whose small
    steps multiply by the plain weights (``lean_step``); then float32 linears keep their plain weight beside the
    packed copy where all of them together take at most ``LEAN_PLAIN_MAX_BYTES``, and bfloat16 ones get no
    float16 copy unless ``ASYNCBATCH_BF16_FP16_KERNEL=1`` asks for it."""
    bfloat16 = model.output_weight.dtype == torch.bfloat16
    max_rows = PACKED_MAX_ROWS if bfloat16 else None
    model.packed_lm_head = PackedHead(model.output_weight, max_rows)
    keep = not bfloat16 and lean_step and _decoder_weight_bytes(model) <= LEAN_PLAIN_MAX_BYTES
    swapped = swap_decoder_linears(model, lambda linear: PackedLinear(linear.weight, linear.bias, max_rows, keep))
    for layer in model.model.layers:
        gate_up = layer.mlp.gate_up_proj
        if gate_up is not None:
            gate_up.splits = (gate_up.out_features // 2,) * 2
    if bfloat16:
        _add_fp16_copies(model, lean_step)
    return swapped


def _decoder_weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.model.layers.modules()
               if isinstance(m, nn.Linear))


def _add_fp16_copies(model: nn.Module, lean_step: bool) -> None:
    """Give each bfloat16 ``PackedLinear`` and the ``PackedHead`` fbgemm's float16 copy of its weight, where
    wanted (``fp16_kernel``); a weight with a value float16 cannot hold keeps the oneDNN path alone."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    weights = [(m, m.weight, m.bias) for m in linears] + [(model.packed_lm_head, model.output_weight, None)]
    if not wants_fp16_kernel(sum(w.numel() * 2 for _, w, _ in weights), lean_step):
        return
    kept = 0
    for module, weight, bias in weights:
        module.fp16 = pack_fp16(weight, bias)
        kept += module.fp16 is not None
    if kept < len(weights):
        logger.info("float16-weight kernel: %d of %d weights hold values float16 cannot; those stay on oneDNN",
                    len(weights) - kept, len(weights))
