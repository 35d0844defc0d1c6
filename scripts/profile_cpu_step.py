#!/usr/bin/env python
"""Where one CPU decode step's time goes: torch.profiler over the real model, by part of the network.

Builds the default model (or ``--model``) as the engine does, in ``--dtype`` and
``--quantization``, and runs pure decode steps of ``--rows`` rows at context
``--context`` (``harness.decode_step``). Each part of the network is
wrapped in a labelled profiler range (module hooks and wrappers installed by
this script only; the engine carries no ranges), and every torch op's self time
goes to the innermost range around it:

    linear q/k/v, linear o, linear gate/up, linear down   the projections
    lm head        final hidden states -> vocabulary logits
    attention      write K/V, gather blocks, SDPA + mask (the rest of paged attention; where the lean kernels
                   attend, in the lean step or in place of the gather, ``ab_decode_attention``: SDPA + mask)
    rope, norms, mlp act (silu * up), embedding, sampling (greedy argmax)
    layer glue     residual adds and views inside a decoder layer; step glue: the rest of the forward

"python" is a range's time not spent inside any torch op (interpreter,
dispatch, the profiler's own bookkeeping, which inflates it). Step times
without the profiler are measured separately and reported beside it.

Writes ``report.md`` and ``report.json`` (and ``--trace`` Chrome traces) into ``--out``.

Example:
    python scripts/profile_cpu_step.py --rows 32,128 --out profiles/cpu-decode-amd-epyc-2core/before
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from harness.common import parser as script_parser
from harness.decode_step import DecodeStepBench
from torch.profiler import ProfilerActivity, profile, record_function

from asyncbatch.bench.report import command_line, machine_info, write_json
from asyncbatch.model import llama, paged_attention
from asyncbatch.profiling.host_info import git_commit

PREFIX = "ab:"
LINEAR_GROUPS = {"q_proj": "linear q/k/v", "k_proj": "linear q/k/v", "v_proj": "linear q/k/v",
                 "qkv_proj": "linear q/k/v", "gate_up_proj": "linear gate/up",
                 "o_proj": "linear o", "gate_proj": "linear gate/up", "up_proj": "linear gate/up",
                 "down_proj": "linear down"}
ORDER = ("linear q/k/v", "linear o", "linear gate/up", "linear down", "lm head", "attention: write K/V",
         "attention: gather blocks", "attention: SDPA + mask", "rope", "norms", "mlp act", "embedding",
         "layer glue", "step glue", "sampling")


def _label_modules(model: torch.nn.Module) -> list:
    """Pre/post forward hooks opening and closing one profiler range per labelled module."""
    handles = []

    def label_of(name: str, module: torch.nn.Module) -> str | None:
        last = name.rsplit(".", 1)[-1]
        if last in LINEAR_GROUPS:
            return LINEAR_GROUPS[last]
        if isinstance(module, llama.RMSNorm):
            return "norms"
        if isinstance(module, llama.MLP):
            return "mlp act"  # what the MLP does outside its three linears
        if isinstance(module, llama.DecoderLayer):
            return "layer glue"
        if last == "embed_tokens":
            return "embedding"
        if isinstance(module, llama.Attention):
            return "attention: SDPA + mask"  # the attention module minus its labelled children
        return None

    for name, module in model.named_modules():
        label = label_of(name, module)
        if label is None:
            continue

        def pre(mod, args, label=label):
            mod._ab_range = torch.ops.profiler._record_function_enter_new(PREFIX + label, None)

        def post(mod, args, out):
            torch.ops.profiler._record_function_exit._RecordFunction(mod._ab_range)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def _wrap(owner, attr: str, label: str):
    original = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        with record_function(PREFIX + label):
            return original(*args, **kwargs)

    setattr(owner, attr, wrapped)
    return lambda: setattr(owner, attr, original)


# The lean CPU step (``model/lean_step.py``) calls no layer module: its C calls and its products get the labels of
# the parts they stand for.
LEAN_KERNEL_LABELS = {"ab_rms_norm": "norms", "ab_add_rms_norm": "norms", "ab_qkv_rope_write": "rope",
                      "ab_decode_attention": "attention: SDPA + mask", "ab_silu_mul": "mlp act"}
LEAN_PRODUCT_LABELS = {"qkv": "linear q/k/v", "o": "linear o", "gate_up": "linear gate/up", "gate": "linear gate/up",
                       "up": "linear gate/up", "down": "linear down"}


class _LabelledKernels:
    """``lean_cpu.c``'s library with each call inside a labelled range."""

    def __init__(self, lib) -> None:
        self.lib = lib

    def __getattr__(self, name: str):
        fn, label = getattr(self.lib, name), LEAN_KERNEL_LABELS.get(name, "step glue")

        def call(*args):
            with record_function(PREFIX + label):
                return fn(*args)
        return call


def _label_lean(bench: DecodeStepBench, rows: int) -> list:
    model = bench.model
    if model.lean_kernels is None:
        return []
    bench.step(rows)  # builds ``model.lean_plan`` where this step is a lean one
    lib, undo = model.lean_kernels, []
    model.lean_kernels = _LabelledKernels(lib)
    undo.append(lambda: setattr(model, "lean_kernels", lib))
    for layer in model.lean_plan or []:
        for attr, label in LEAN_PRODUCT_LABELS.items():
            if getattr(layer, attr) is not None:
                undo.append(_wrap(layer, attr, label))
    return undo


def install_labels(bench: DecodeStepBench, rows: int) -> list:
    """Label every part of the step; returns callables that undo it."""
    undo = [h.remove for h in _label_modules(bench.model)] + _label_lean(bench, rows)
    undo.append(_wrap(llama, "apply_rope", "rope"))
    undo.append(_wrap(paged_attention, "write_kv", "attention: write K/V"))
    undo.append(_wrap(paged_attention, "gather_blocks", "attention: gather blocks"))
    undo.append(_wrap(bench.model, "compute_logits", "lm head"))
    from harness import decode_step
    undo.append(_wrap(decode_step, "sample", "sampling"))
    return undo


def attribute(events, steps: int) -> dict[str, dict[str, float]]:
    """Per label: ``op_ms`` (self time of torch ops inside it) and ``python_ms`` (the range's time outside
    any op and outside nested labels), per step."""
    op_us: dict[str, float] = defaultdict(float)
    range_us: dict[str, float] = defaultdict(float)
    for e in events:
        if e.name.startswith(PREFIX):
            label = e.name[len(PREFIX):]
            range_us[label] += e.cpu_time_total
            parent = _label_above(e.cpu_parent)
            if parent is not None:
                range_us[parent] -= e.cpu_time_total
            continue
        label = _label_above(e) or "step glue"
        op_us[label] += e.self_cpu_time_total
    out = {}
    for label in set(op_us) | set(range_us):
        ops = op_us.get(label, 0.0)
        total = range_us.get(label, ops)
        out[label] = {"op_ms": ops / steps / 1e3, "python_ms": max(total - ops, 0.0) / steps / 1e3}
    return out


def _label_above(e):
    while e is not None:
        if e.name.startswith(PREFIX):
            return e.name[len(PREFIX):]
        e = e.cpu_parent
    return None


def top_ops(events, steps: int, n: int = 12) -> list[dict]:
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if not e.name.startswith(PREFIX):
            agg[e.name][0] += e.self_cpu_time_total
            agg[e.name][1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"op": k, "self_ms_per_step": v[0] / steps / 1e3, "calls_per_step": v[1] / steps} for k, v in rows]


def profile_rows(bench: DecodeStepBench, rows: int, steps: int, trace: Path | None) -> dict:
    timing = bench.time_steps(rows, repeats=steps, warmup=2)
    undo = install_labels(bench, rows)
    try:
        bench.step(rows)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with record_function(PREFIX + "step"):
                    bench.step(rows)
    finally:
        for u in reversed(undo):
            u()
    events = prof.events()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    parts = attribute(events, steps)
    step_total = parts.pop("step", {"op_ms": 0.0, "python_ms": 0.0})
    profiled_ms = sum(p["op_ms"] + p["python_ms"] for p in parts.values()) + step_total["python_ms"]
    parts.setdefault("step glue", {"op_ms": 0.0, "python_ms": 0.0})["python_ms"] += step_total["python_ms"]
    return {"rows": rows, "context": bench.context, "step_ms_median": timing.median_ms, "step_ms_min": timing.min_ms,
            "step_cpu_ms_median": timing.cpu_median_ms,
            "step_ms_samples": timing.samples_ms, "profiled_step_ms": profiled_ms,
            "aten_ops_per_step": sum(e.name.startswith("aten::") for e in events) / steps,
            "parts": {k: parts[k] for k in sorted(parts, key=lambda k: ORDER.index(k) if k in ORDER else 99)},
            "top_ops": top_ops(events, steps)}


def markdown(doc: dict) -> str:
    lines = [f"# One CPU decode step, by part ({doc['title']})", "",
             (f"Machine: {doc['machine']['cpu']}, {doc['machine']['cores']} cores, torch "
              f"{doc['machine']['torch']} (capability {doc['machine']['capability']}), {doc['threads']} torch "
              f"threads; load average at start {doc['load_average']}. Commit {doc['git_commit']}."), "",
             f"Command: `{doc['command']}`", "",
             f"Model weights: {doc['weights']}; context {doc['context']} tokens per row.", ""]
    for r in doc["results"]:
        lines += [f"## {r['rows']} rows", "",
                  (f"Step without the profiler: median {r['step_ms_median']:.1f} ms "
                   f"(min {r['step_ms_min']:.1f}), CPU time {r['step_cpu_ms_median']:.1f} ms; under the profiler "
                   f"{r['profiled_step_ms']:.1f} ms (wall clock: the table's times include waits for the cores "
                   f"on a shared machine); {r['aten_ops_per_step']:.0f} aten ops per step (every level)."), "",
                  "| part | torch ops ms | python ms | share |", "|---|---|---|---|"]
        total = r["profiled_step_ms"] or 1.0
        for name, p in r["parts"].items():
            share = 100 * (p["op_ms"] + p["python_ms"]) / total
            lines.append(f"| {name} | {p['op_ms']:.2f} | {p['python_ms']:.2f} | {share:.1f} % |")
        lines += ["", "Top ops by self time per step:", "", "| op | ms | calls |", "|---|---|---|"]
        lines += [f"| `{o['op']}` | {o['self_ms_per_step']:.2f} | {o['calls_per_step']:.0f} |" for o in r["top_ops"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--quantization", default=None, help="None, int8 or int4 (weight-only)")
    parser.add_argument("--rows", default="32,128", help="comma list of decode rows")
    parser.add_argument("--context", type=int, default=128, help="tokens of context per row")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per row count")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--trace", action="store_true", help="also write trace_<rows>.json per row count")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    rows = [int(x) for x in args.rows.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = DecodeStepBench(args.model, args.dtype, args.quantization, max_rows=max(rows), context=args.context,
                            threads=threads)
    quant = args.quantization or "none"
    doc = {"title": args.title or f"{bench.dtype}, quantization {quant}",
           "command": command_line(),
           "git_commit": git_commit(), "threads": threads, "load_average": [round(x, 2) for x in os.getloadavg()],
           "machine": {**machine_info("cpu"), "capability": torch.backends.cpu.get_cpu_capability()},
           "weights": f"{bench.dtype}, quantization {quant}, {bench.weight_bytes() / 2**20:.0f} MiB read per step",
           "context": args.context, "results": []}
    for r in rows:
        print(f"profiling {r} rows ...", file=sys.stderr, flush=True)
        doc["results"].append(profile_rows(bench, r, args.steps, out / f"trace_{r}.json" if args.trace else None))
    write_json(doc, out / "report.json", nan_as_null=True)
    text = markdown(doc)
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
