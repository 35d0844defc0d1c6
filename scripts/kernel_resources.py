#!/usr/bin/env python
"""Compile the Triton attention kernels ahead of time for a GPU architecture, on any machine.

No GPU is needed: Triton's NVIDIA backend lowers each kernel to PTX and
assembles a cubin for ``--arch`` (default 90, Hopper: H100/H200) with the
ptxas it ships. For every model shape below and every dtype, the script
compiles exactly the launches ``decode_launch``, ``split_decode`` (one split
and eight, then the merge) and ``prefill_launch`` choose
(the same constexprs and warps the engine would launch with), reads the
cubin's registers and stack frame (where spilled registers go) with the
``cuobjdump`` Triton ships, and takes the shared memory from Triton's metadata.
A kernel that fails to compile for the GPU fails here, which the CPU
interpreter (``TRITON_INTERPRET=1``) cannot show.

    python scripts/kernel_resources.py --out profiles/triton-kernels-sm90

Exit status 1 if any launch fails to compile. Runtime specialisation may
differ in detail (Triton also specialises integer arguments by divisibility
at launch); the kernels' code and tiles are the same.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, do not interpret

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from asyncbatch.model import split_decode
from asyncbatch.model import triton_attention as ta

# (query heads, KV heads, head_dim) of models people serve; the first is the default model.
MODEL_SHAPES = {
    "SmolLM2-135M": (9, 3, 64),
    "SmolLM2-360M": (15, 5, 64),
    "Llama-3.2-1B": (32, 8, 64),
    "Qwen3-0.6B": (16, 8, 128),
    "Llama-3.1-8B": (32, 8, 128),
    "Qwen2.5-7B": (28, 4, 128),
    "tests' tiny models": (4, 2, 16),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INDEX_POINTERS = ("tables_ptr", "lens_ptr", "rows_ptr")
FLOAT32_POINTERS = ("part_acc_ptr", "part_ml_ptr")  # the split decode's partial softmaxes


@dataclass(slots=True)
class CompiledLaunch:
    kernel: str
    model: str
    dtype: str
    tile: str
    num_warps: int
    ok: bool
    registers: int | None = None
    stack_bytes: int | None = None  # per thread: the stack frame, where ptxas puts spilled registers
    shared_bytes: int | None = None
    error: str = ""


def signature(fn: triton.JITFunction, dtype: str, constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ("*i64" if name in INDEX_POINTERS else "*fp32" if name in FLOAT32_POINTERS
                         else f"*{dtype}")
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK of the cubin's one function, from the cuobjdump Triton ships (empty if absent)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=False, capture_output=True,
                              text=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK):(\d+)", text)}


def compile_launch(kernel: str, model: str, dtype: str, launch: ta.KernelLaunch, arch: int) -> CompiledLaunch:
    fn = {"decode": ta._decode_kernel, "split": split_decode._split_decode_kernel,
          "merge": split_decode._decode_merge_kernel, "prefill": ta._prefill_kernel}[kernel]
    c = launch.constexprs
    fp32 = " fp32-dot" if c.get("FP32_DOT") else ""  # the merge kernel has no products
    if kernel == "decode":
        tile = f"G{c['GROUP_PAD']}xN{c['BLOCK_N']}xD{c['DIM_PAD']}"
    elif kernel == "split":
        tile = f"G{c['GROUP_PAD']}xN{c['BLOCK_N']}xD{c['DIM_PAD']} S{c['SPLITS']}{fp32}"
    elif kernel == "merge":
        tile = f"S{c['SPLITS']}xD{c['DIM_PAD']}"
    else:
        tile = f"M{c['BLOCK_M']}xN{c['BLOCK_N']}xD{c['DIM_PAD']}{fp32}"
    row = CompiledLaunch(kernel, model, dtype, tile, launch.num_warps, ok=False)
    try:
        compiled = triton.compile(ASTSource(fn, signature(fn, dtype, c), c), target=GPUTarget("cuda", arch, 32),
                                  options=launch.options())
    except Exception as exc:  # noqa: BLE001 - report every failing launch, not just the first
        row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc()
        return row
    usage = resource_usage(compiled.asm["cubin"])
    row.ok = True
    row.registers, row.stack_bytes = usage.get("REG"), usage.get("STACK")
    row.shared_bytes = compiled.metadata.shared
    return row


def all_launches(block_size: int) -> list[tuple[str, str, str, ta.KernelLaunch]]:
    launches = []
    for model, (heads, kv_heads, head_dim) in MODEL_SHAPES.items():
        group = heads // kv_heads
        for dtype, torch_dtype in DTYPES.items():
            launches.append(("decode", model, dtype, ta.decode_launch(group, head_dim, block_size)))
            for splits in (1, 8):  # the output written directly, and partials for the merge kernel
                split = split_decode.split_decode_launch(group, head_dim, block_size, splits,
                                                         fp32_dot=torch_dtype == torch.float32)
                launches.append(("split", model, dtype, split))
            launches.append(("merge", model, dtype, split_decode.merge_launch(split)))
            for max_q_len in (16, 512):  # short chunks (16-row tiles) and long ones (64-row tiles)
                launches.append(("prefill", model, dtype, ta.prefill_launch(
                    group, head_dim, block_size, max_q_len, fp32_dot=torch_dtype == torch.float32)))
    return launches


def render(rows: list[CompiledLaunch], header: str) -> str:
    lines = [header, "", "| kernel | model | dtype | tile | warps | registers | stack B | shared B | compiled |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.kernel} | {r.model} | {r.dtype} | {r.tile} | {r.num_warps} | {r.registers} | "
                     f"{r.stack_bytes} | {r.shared_bytes} | {'yes' if r.ok else 'NO: ' + r.error} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (the engine's default: 16)")
    parser.add_argument("--out", default=None, help="folder for kernel_resources.{json,md}")
    parser.add_argument("--only", default=None, help="compile only this model shape (a MODEL_SHAPES key)")
    args = parser.parse_args(argv)
    launches = [x for x in all_launches(args.block_size) if args.only in (None, x[1])]
    if not launches:
        parser.error(f"--only must be one of {list(MODEL_SHAPES)}")
    rows = [compile_launch(kernel, model, dtype, launch, args.arch) for kernel, model, dtype, launch in launches]
    header = (f"Triton {triton.__version__} -> sm_{args.arch} cubins, KV block size {args.block_size}, compiled on "
              f"{platform.processor() or platform.machine()} (no GPU needed); torch {torch.__version__}")
    text = render(rows, header)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernel_resources.json").write_text(json.dumps(
            {"triton": triton.__version__, "arch": args.arch, "block_size": args.block_size,
             "launches": [asdict(r) for r in rows]}, indent=2))
        (out / "kernel_resources.md").write_text(text + "\n")
    print(text)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} launches compiled for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
