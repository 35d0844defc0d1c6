#!/usr/bin/env python
"""Quality per weight precision: teacher-forced top-1 agreement with float32, and perplexity, side by side.

Every precision reads the same shipped text (``scripts/harness/data/quality_text.txt``,
~2,400 tokens of prose written for the project) through the engine's own model code
over the paged KV cache (``harness.quality``); the float32 model is the reference.

Example:
    python scripts/eval_quality.py --out profiles/cpu-decode-amd-epyc-2core
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from harness.common import parser as script_parser
from harness.quality import QUALITY_TEXT, agreement, teacher_forced

from asyncbatch.bench.report import write_json
from asyncbatch.model.loader import load_model, load_tokenizer, resolve_model_path

PRECISIONS = ("float32", "bfloat16", "int8", "int4", "w8a8")


def parse_precision(name: str) -> tuple[torch.dtype, str | None]:
    """``float32`` / ``bfloat16``: that dtype everywhere; a quantization: float32 activations, quantized weights."""
    if name in ("float32", "bfloat16"):
        return getattr(torch, name), None
    return torch.float32, name


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--chunk", type=int, default=8, help="tokens per forward (rows each linear sees)")
    parser.add_argument("--max-tokens", type=int, default=None, help="only the text's first N tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write quality.json and quality.md here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    path = resolve_model_path(args.model)
    ids = load_tokenizer(path)(QUALITY_TEXT.read_text())["input_ids"][:args.max_tokens]
    max_positions = len(ids) + 1
    rows, reference = [], None
    for name in ["float32", *[p for p in args.precisions.split(",") if p and p != "float32"]]:
        dtype, quant = parse_precision(name)
        model = load_model(path, dtype, "cpu", max_positions, quantization=quant)
        t0 = time.perf_counter()
        result = teacher_forced(model, ids, chunk=args.chunk)
        seconds = time.perf_counter() - t0
        reference = reference or result
        row = {"precision": name, "dtype": str(dtype).removeprefix("torch."), "quantization": quant,
               "top1_agreement": agreement(result, reference),
               "top1_agreement_margin_0.1": agreement(result, reference, min_margin=0.1),
               "perplexity": result.perplexity, "seconds": seconds}
        rows.append(row)
        print(f"{name:<9} top-1 agreement {100 * row['top1_agreement']:6.2f} % (margin > 0.1: "
              f"{100 * row['top1_agreement_margin_0.1']:6.2f} %)  perplexity {row['perplexity']:7.3f}"
              f"  ({seconds:.0f} s)", file=sys.stderr, flush=True)
    doc = {"model_path": str(path), "text": QUALITY_TEXT.name, "tokens": len(ids), "chunk": args.chunk,
           "threads": torch.get_num_threads(), "results": rows}
    confident = 100 * sum(bool(m > 0.1) for m in reference.margin.tolist()) / len(reference.margin)
    header = ("| precision | top-1 agreement with float32 | same, where float32's top-1 leads its top-2 by > 0.1 "
              f"({confident:.0f} % of positions) | perplexity |")
    table = [header, "|---|---|---|---|"]
    table += [f"| {r['precision']} | {100 * r['top1_agreement']:.2f} % | {100 * r['top1_agreement_margin_0.1']:.2f} % "
              f"| {r['perplexity']:.3f} |" for r in rows]
    print("\n".join(table))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(doc, out / "quality.json", nan_as_null=True)
        (out / "quality.md").write_text(
            f"Teacher-forced on {len(ids)} tokens of `{QUALITY_TEXT.name}`, {args.chunk} tokens per forward.\n\n"
            + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
