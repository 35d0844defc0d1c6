#!/usr/bin/env python
"""Time the Triton paged-attention kernels against the torch reference, and their tile choices.

For one model shape (default: SmolLM2-135M, 9 query heads over 3 KV heads,
head_dim 64, KV block size 16) on random data with every row's blocks
scattered through the cache:

* decode: ``--rows`` rows of ``--context`` cached tokens each (or each of
  ``--decode-shapes``); the grouped kernel (``decode_launch``) and its key
  tiles x warps; the split kernel (``split_decode``, the engine's) as it chooses
  for the shape and its neighbours (split counts, key tiles, warps; all of
  them, and pipeline stages, with ``--sweep``); and the torch reference
  (gather + SDPA) the engine falls back to without Triton; with the KV bytes
  each reads per microsecond;
* prefill: ``--prefill-rows`` chunks of ``--prefill-len`` new tokens after
  as many cached ones; ``prefill_launch``'s choice and its warps flipped.

Every variant's output is compared with the engine's launch (max |diff|), so a
fast but wrong tile shows up as such. Times: median over ``--repeats`` batches
of ``--calls`` back-to-back launches, each batch captured into a CUDA graph and
timed with events around its replay, so host launch overhead is not counted
(the L2 is not flushed; the decode K/V of the default sizes exceed it anyway).
``gpu_check.sh`` runs this on a GPU; ``--device cpu`` runs the kernels in
Triton's interpreter, only to smoke-test the script.

    python scripts/attention_bench.py --out results/attention
"""

from __future__ import annotations

import argparse
import os
import sys

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from asyncbatch.model import paged_attention as reference
from asyncbatch.model import split_decode
from asyncbatch.model import triton_attention as kernels


@dataclass(slots=True)
class Timing:
    kernel: str
    variant: str
    ms: float
    gb_per_s: float | None  # KV bytes read per second (decode only)
    max_abs_diff: float  # against the engine's own launch
    timing: str  # how ``ms`` was measured (see median_ms)
    shape: str = ""  # decode: rows x cached tokens


def median_ms(fn: Callable[[], object], device: torch.device, calls: int, repeats: int) -> tuple[float, str]:
    """Median time of one call over ``repeats`` batches of ``calls`` back-to-back calls, and how it was taken.

    On CUDA the batch is captured into a CUDA graph and its replays are timed, so
    the figure is the kernels' time, not Python's launch overhead (a Triton launch
    costs tens of microseconds on the host, as much as a small prefill on the GPU).
    If capture fails, the calls are timed as launched, and the method says so.
    """
    fn()  # compile / warm up

    def launches() -> None:
        for _ in range(calls):
            fn()

    batch: Callable[[], object] = launches
    method = "host timer"
    if device.type == "cuda":
        method = "cuda graph replay"
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launches()
            batch = graph.replay
        except RuntimeError as exc:
            method = f"events around launches ({type(exc).__name__} in capture)"
        batch()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batch()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            batch()
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(samples), method


def host_us_per_launch(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Host microseconds per call of ``calls`` back-to-back launches, not waiting for the device: what an eager
    step pays per kernel in Python and the driver (a captured graph pays none of it)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed * 1e6 / calls


def scattered_tables(rows: int, blocks_per_row: int, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Each row's blocks at random distinct places in the cache (block 0, the engine's dummy, unused)."""
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1))[:rows * blocks_per_row] + 1
    return perm.view(rows, blocks_per_row).to(device)


DecodeFn = Callable[..., torch.Tensor]


def grouped_variants(q: torch.Tensor, k_cache: torch.Tensor) -> dict[str, tuple[DecodeFn, kernels.KernelLaunch]]:
    """The grouped kernel (the engine's until the first GPU run): ``decode_launch``'s choice, then key tiles x
    warps."""
    heads, head_dim = q.shape[1], q.shape[2]
    chosen = kernels.decode_launch(heads // k_cache.shape[2], head_dim, k_cache.shape[1])
    variants = {f"grouped N{chosen.constexprs['BLOCK_N']}, {chosen.num_warps} warps (its choice)":
                (kernels.decode_attention, chosen)}
    for block_n in (16, 32, 64):
        for warps in (4, 8):
            launch = kernels.KernelLaunch({**chosen.constexprs, "BLOCK_N": block_n}, warps)
            if launch != chosen:
                variants[f"grouped N{block_n}, {warps} warps"] = (kernels.decode_attention, launch)
    return variants


def split_variants(q: torch.Tensor, k_cache: torch.Tensor, table_width: int,
                   sweep: bool) -> dict[str, tuple[DecodeFn, kernels.KernelLaunch]]:
    """The split kernel: ``split_decode.engine_launch``'s choice for the shape, then its neighbours (half
    and double the splits, the other key tiles, 8 warps; ``sweep``: every split count 1-16 x key tiles
    16-64, and warps x pipeline stages)."""
    chosen = split_decode.engine_launch(q, k_cache, table_width)
    c = chosen.constexprs

    def name(launch: kernels.KernelLaunch) -> str:
        k = launch.constexprs
        stages = "" if launch.num_stages is None else f", {launch.num_stages} stages"
        return f"split S{k['SPLITS']} N{k['BLOCK_N']}, {launch.num_warps} warps{stages}"

    variants = {f"{name(chosen)} (engine)": (split_decode.split_decode_attention, chosen)}
    if sweep:
        grid = [(s, n, 4, None) for s in (1, 2, 4, 8, 16) for n in (16, 32, 64)]
        grid += [(c["SPLITS"], c["BLOCK_N"], w, st) for w in (2, 4, 8) for st in (1, 2, 3)]
    else:
        grid = [(max(1, c["SPLITS"] // 2), c["BLOCK_N"], 4, None), (c["SPLITS"] * 2, c["BLOCK_N"], 4, None)]
        grid += [(c["SPLITS"], n, 4, None) for n in (16, 32, 64)] + [(c["SPLITS"], c["BLOCK_N"], 8, None)]
    for splits, block_n, warps, stages in grid:
        launch = kernels.KernelLaunch({**c, "SPLITS": splits, "BLOCK_N": block_n}, warps, stages)
        if launch != chosen:
            variants.setdefault(name(launch), (split_decode.split_decode_attention, launch))
    return variants


def bench_decode(args, rows: int, context: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[list[Timing], dict[str, float]]:
    """The shape's timings, and the host's microseconds per launch of each kernel's own choice, the torch
    reference and one torch elementwise product (for scale)."""
    heads, kv_heads, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    blocks_per_row = -(-context // bs)
    num_blocks = rows * blocks_per_row + 1
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(device, dtype)
    q = torch.randn(rows, heads, d, generator=g).to(device, dtype)
    tables = scattered_tables(rows, blocks_per_row, num_blocks, device)
    lens = torch.full((rows,), context, dtype=torch.int64, device=device)
    scale = d ** -0.5
    kv_bytes = 2 * rows * context * kv_heads * d * k_cache.element_size()
    shape = f"{rows}x{context}"
    variants = grouped_variants(q, k_cache) | split_variants(q, k_cache, tables.shape[1], args.sweep)
    want = kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale)  # the grouped kernel's choice
    results = []
    for name, (fn, launch) in variants.items():
        out = torch.empty_like(q)

        def run(fn=fn, launch=launch, out=out):
            return fn(q, k_cache, v_cache, tables, lens, scale, out=out, launch=launch)

        ms, how = median_ms(run, device, args.calls, args.repeats)
        diff = (run().float() - want.float()).abs().max().item()
        results.append(Timing("decode", name, ms, kv_bytes / ms / 1e6, diff, how, shape))

    def ref():
        return reference.decode_attention(q, k_cache, v_cache, tables, lens, scale)

    ms, how = median_ms(ref, device, args.calls, args.repeats)
    results.append(Timing("decode", "torch reference (gather + SDPA)", ms, kv_bytes / ms / 1e6,
                          (ref().float() - want.float()).abs().max().item(), how, shape))
    calls = 10 * args.calls
    launches = {name.split(" (")[0]: host_us_per_launch(lambda fn=fn, launch=launch: fn(
                    q, k_cache, v_cache, tables, lens, scale, launch=launch), device, calls)
                for name, (fn, launch) in variants.items() if name.endswith(("(its choice)", "(engine)"))}
    launches["torch reference (gather + SDPA)"] = host_us_per_launch(ref, device, calls)
    launches["torch elementwise product (q * 2)"] = host_us_per_launch(lambda: q * 2, device, calls)
    return results, launches


def bench_prefill(args, device: torch.device, dtype: torch.dtype) -> list[Timing]:
    heads, kv_heads, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    q_len, ctx = args.prefill_len, 2 * args.prefill_len  # each chunk follows as many cached tokens
    blocks_per_row = -(-ctx // bs)
    num_blocks = args.prefill_rows * blocks_per_row + 1
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(device, dtype)
    q = torch.randn(args.prefill_rows * q_len, heads, d, generator=g).to(device, dtype)
    tables = scattered_tables(args.prefill_rows, blocks_per_row, num_blocks, device)
    rows = torch.tensor([(i * q_len, q_len, ctx) for i in range(args.prefill_rows)], dtype=torch.int64,
                        device=device)
    scale = d ** -0.5
    fp32_dot = dtype == torch.float32 or device.type != "cuda"
    chosen = kernels.prefill_launch(heads // kv_heads, d, bs, q_len, fp32_dot=fp32_dot)
    flipped = kernels.KernelLaunch(chosen.constexprs, 12 - chosen.num_warps)  # 4 <-> 8
    c = chosen.constexprs
    variants = {f"engine (M{c['BLOCK_M']}xN{c['BLOCK_N']}, {chosen.num_warps} warps)": chosen,
                f"M{c['BLOCK_M']}xN{c['BLOCK_N']}, {flipped.num_warps} warps": flipped}
    want = None
    results = []
    for name, launch in variants.items():
        out = torch.zeros_like(q)

        def run(launch=launch, out=out):
            return kernels.prefill_attention(q, k_cache, v_cache, tables, rows, q_len, scale, out, launch=launch)

        ms, how = median_ms(run, device, args.calls, args.repeats)
        got = run().float()
        want = got if want is None else want
        results.append(Timing("prefill", name, ms, None, (got - want).abs().max().item(), how,
                              f"{args.prefill_rows}x{q_len}"))
    return results


def render(report: dict) -> str:
    a = report["args"]
    lines = [(f"attention kernels on {report['device']}, torch {report['torch']}, triton {report['triton']}, "
              f"{a['dtype']}, {a['heads']} heads / {a['kv_heads']} KV heads x {a['head_dim']}, "
              f"block {a['block_size']}"),
             (f"decode: rows x cached tokens {', '.join(report['decode_shapes'])}; prefill: {a['prefill_rows']} "
              f"chunks x {a['prefill_len']} tokens after {a['prefill_len']} cached"),
             f"{'kernel':<8} {'shape':<10} {'variant':<34} {'us':>9} {'GB/s':>8} {'max|diff|':>10}  timing"]
    for t in report["timings"]:
        gbs = f"{t['gb_per_s']:.0f}" if t["gb_per_s"] is not None else "-"
        lines.append(f"{t['kernel']:<8} {t['shape']:<10} {t['variant']:<34} {t['ms'] * 1e3:>9.1f} {gbs:>8} "
                     f"{t['max_abs_diff']:>10.2e}  {t['timing']}")
    lines.append("host us per eager launch (Python and driver, device not awaited; graphs pay none of it):")
    for shape, launches in report.get("host_us_per_launch", {}).items():
        lines += [f"  {shape:<10} {name:<40} {us:>9.1f}" for name, us in launches.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for attention_bench.{json,md}")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the interpreter (a smoke test only)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--decode-shapes", default=None,
                        help="ROWSxCONTEXT,... decode shapes instead of --rows x --context (e.g. 256x512,8x4096)")
    parser.add_argument("--sweep", action="store_true",
                        help="every decode split count and key tile, and warps x pipeline stages")
    parser.add_argument("--prefill-rows", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device (use --device cpu to smoke-test)")
    dtype = getattr(torch, args.dtype)
    shapes = args.decode_shapes.split(",") if args.decode_shapes else [f"{args.rows}x{args.context}"]
    timings: list[Timing] = []
    launch_us: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for shape in shapes:
            rows, context = (int(x) for x in shape.lower().split("x"))
            shape_timings, launch_us[shape] = bench_decode(args, rows, context, device, dtype)
            timings += shape_timings
        timings += bench_prefill(args, device, dtype)
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU interpreter ({platform.machine()})"
    report = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "args": vars(args),
              "decode_shapes": shapes,
              "timings": [asdict(t) for t in timings], "host_us_per_launch": launch_us}
    text = render(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attention_bench.json").write_text(json.dumps(report, indent=2))
        (out / "attention_bench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
