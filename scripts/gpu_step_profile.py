#!/usr/bin/env python
"""Where one decode step's device time goes on a GPU: the engine's model, kernel by kernel.

For ``--rows`` decode rows at each of ``--contexts`` cached tokens, and for each of ``--decode-kernels``
(``triton_attention.DECODE_KERNELS``; ``KERNEL+fused``: with ``fused_elementwise``'s kernels), runs the
model's forward and greedy sampling (as ``harness.decode_step`` builds them: every row one token, its own
blocks) ``--steps`` times under ``torch.profiler`` and sums the device time of every kernel: by kind (matrix products, decode attention,
the KV write, elementwise, reductions, sampling's argmax, copies) and the slowest kernels by name. Beside it,
the step's time as the engine sees it: the same steps captured into one CUDA graph and replayed, timed with
events (no launch overhead), so "kernels" and "graph replay" can be compared (their difference is the gaps
between kernels).

The model: ``--model`` (a checkpoint directory), else random weights of SmolLM2-135M's shape (as
``gpu_bench.py`` builds them). ``--device cpu`` runs the same code on the CPU (aten ops instead of kernels,
no graph) only to test this script; ``gpu_check.sh`` runs it on a GPU. Writes ``step_profile.md`` and
``step_profile.json`` into ``--out``.

    python scripts/gpu_step_profile.py --out results/step-profile
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # the fused kernels on CPU tensors (a smoke test); before triton's import

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_bench import find_model, random_weights_model
from harness.decode_step import BLOCK_SIZE, decode_batch, greedy_sampling

from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.loader import load_model
from asyncbatch.profiling.host_info import git_commit
from asyncbatch.sampling.sampler import SamplingTensors, sample

# Kernel name -> kind: the first pattern that matches (case-insensitive) wins.
KINDS = (
    ("decode attention", r"_decode_kernel|_split_decode_kernel|_decode_merge_kernel|flash|sdpa|attention"),
    ("prefill attention", r"_prefill_kernel"),
    ("matrix products", r"gemm|gemv|cutlass|nvjet|xmma|sm90_|sm80_|cublas|matmul|\bmm\b|addmm|linear"),
    ("KV write / gather", r"index|scatter|gather|write_kv"),
    ("sampling (argmax)", r"argmax|max_kernel|arg_reduce"),
    ("reductions (norms)", r"reduce|norm|mean|pow"),
    ("elementwise", r"elementwise|vectorized|unrolled|silu|mul|add|cat|rope|copy_kernel"),
    ("copies", r"memcpy|memset|copy"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def _device_batch(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    return ForwardBatch(input_ids=batch.input_ids.to(device), positions=batch.positions.to(device),
                        slot_mapping=batch.slot_mapping.to(device), num_decode=batch.num_decode,
                        decode_block_tables=batch.decode_block_tables.to(device),
                        decode_context_lens=batch.decode_context_lens.to(device), prefill_rows=[],
                        logits_indices=batch.logits_indices.to(device))


def _device_sampling(st: SamplingTensors, device: torch.device) -> SamplingTensors:
    return SamplingTensors(*(t.to(device) for t in (st.temperature, st.top_k, st.top_p, st.min_p, st.seed,
                                                    st.step)))


def _self_time_us(event, cuda: bool) -> float:
    """An averaged event's own time on its device, in microseconds, whatever torch names the field."""
    if not cuda:
        return event.self_cpu_time_total
    for field in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, field):
            return getattr(event, field)
    return 0.0


def profile_case(model, kv_caches, rows: int, context: int, steps: int, device: torch.device) -> dict:
    """One (rows, context) case with the decode kernel set now: kernel time by kind and name, graph replay."""
    cuda = device.type == "cuda"
    batch = _device_batch(decode_batch(rows, context, vocab=int(model.config.vocab_size)), device)
    sampling = _device_sampling(greedy_sampling(rows), device)

    def step() -> torch.Tensor:
        return sample(model(batch, kv_caches), sampling, all_greedy=True).token_ids

    with torch.inference_mode():
        for _ in range(2):  # compile the kernels, warm the allocator
            step()
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
        on_device = DeviceType.CUDA if cuda else DeviceType.CPU
        by_name: dict[str, float] = defaultdict(float)
        for event in prof.key_averages():
            if event.device_type == on_device:
                by_name[event.key] += _self_time_us(event, cuda) / steps
        replay_us = None
        if cuda:
            try:
                replay_us = _graph_replay_us(step, steps)
            except RuntimeError as exc:  # a capture that fails must not hide the kernel table
                print(f"graph capture failed: {type(exc).__name__}: {exc}", flush=True)
        wall_us = _wall_us(step, steps, cuda)
    by_kind: dict[str, float] = defaultdict(float)
    for name, us in by_name.items():
        by_kind[kind_of(name)] += us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"rows": rows, "context": context, "kernel_us_per_step": sum(by_name.values()),
            "graph_replay_us_per_step": replay_us, "eager_wall_us_per_step": wall_us,
            "by_kind_us": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top_kernels_us": [{"name": n, "us": us, "kind": kind_of(n)} for n, us in top]}


def _graph_replay_us(step, steps: int) -> float:
    """The steps captured into one CUDA graph, replayed 5 times; median microseconds per step."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # a warm-up on the capture stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(steps):
            step()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / steps)
    return statistics.median(samples)


def _wall_us(step, steps: int, cuda: bool) -> float:
    """Eager steps as launched (Python and launch overhead included), median microseconds per step."""
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / steps)
    return statistics.median(samples)


def render(report: dict) -> str:
    lines = [(f"decode step profile on {report['device']}, torch {report['torch']}, {report['dtype']}, "
              f"{report['model_note']}"),
             ("us per step; 'kernels' = the sum of kernel times under torch.profiler, 'graph' = the steps as one "
              "CUDA graph replayed (what the engine runs), 'eager' = launched from Python")]
    for case in report["cases"]:
        graph = case["graph_replay_us_per_step"]
        graph_text = f", graph {graph:.0f}" if graph is not None else ""
        fused = " + fused elementwise" if case.get("fused_elementwise") else ""
        lines += ["", (f"## {case['decode_kernel']} decode kernel{fused}, {case['rows']} rows x {case['context']} "
                       f"cached: "
                       f"kernels {case['kernel_us_per_step']:.0f}{graph_text}, "
                       f"eager {case['eager_wall_us_per_step']:.0f}")]
        total = case["kernel_us_per_step"] or 1.0
        lines += [f"  {kind:<20} {us:>9.1f}  {100 * us / total:5.1f} %" for kind, us in case["by_kind_us"].items()]
        lines += ["  slowest kernels:"]
        lines += [f"    {k['us']:>9.1f}  {k['kind']:<20} {k['name'][:90]}" for k in case["top_kernels_us"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: random SmolLM2-135M)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to test this script")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--contexts", default="128,512", help="cached tokens per row, comma-separated")
    parser.add_argument("--decode-kernels", default="grouped,split,split+fused",
                        help="decode kernels, comma-separated; NAME+fused: with fused_elementwise's kernels")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device (use --device cpu to test the script)")
    if args.model:
        path, note = Path(args.model), f"model {args.model}"
    else:
        found, partial, _source = find_model(None)
        path = found or random_weights_model(partial, Path(tempfile.mkdtemp(prefix="smollm2-random-")))
        note = f"model {found.name}" if found else "RANDOM weights of SmolLM2-135M's shape"
    contexts = [int(c) for c in args.contexts.split(",")]
    model = load_model(path, getattr(torch, args.dtype), device, max_positions=max(contexts))
    kv_caches = model.new_kv_caches(1 + args.rows * -(-max(contexts) // BLOCK_SIZE), BLOCK_SIZE)
    cases = []
    for variant in args.decode_kernels.split(","):
        name, *tags = variant.split("+")
        if device.type == "cuda":
            from asyncbatch.model import triton_attention

            triton_attention.set_decode_kernel(name)
        if "fused" in tags:  # for the rest of the run: the gate/up product stays fused (list it last)
            from asyncbatch.model import fused_elementwise

            fused_elementwise.enable(model)
        for context in contexts:
            print(f"profiling {variant}, {args.rows} rows x {context} ...", flush=True)
            cases.append({"decode_kernel": name, "fused_elementwise": "fused" in tags,
                          **profile_case(model, kv_caches, args.rows, context, args.steps, device)})
        model.fused_elementwise = None  # the kernels off again (the gate/up product stays one)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (aten ops, a smoke test)"
    report = {"device": device_name, "torch": torch.__version__, "dtype": args.dtype, "model_note": note,
              "git_commit": git_commit(), "args": vars(args), "cases": cases}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps(report, indent=2))
    text = render(report)
    (out / "step_profile.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
