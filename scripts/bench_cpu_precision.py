#!/usr/bin/env python
"""CPU precisions side by side in one run: decode step time vs rows beside the memory floor, and output tok/s.

1. Memory bandwidth: the best of several copies of a 256 MiB tensor (bytes read + written / time).
2. Decode step time (forward + greedy sampling, ``harness.decode_step``) at each of ``--rows``
   per precision, beside the step's memory-traffic floor: (weights read in full + the rows' KV cache)
   / bandwidth.
3. Offline output tok/s on two workloads, 32 x (64 prompt + 128 output) tokens and the README's 32 requests
   (prompts 16-128, outputs 8-128), greedy, ``ignore_eos``: asyncbatch (overlap) per precision, transformers
   ``generate_batch`` in float32, and llama.cpp on the same GGUF file when llama-cpp-python is installed.
4. One request alone (the README's chat prompt, 48 tokens): asyncbatch per precision and llama.cpp.

Systems run one after another (one engine in memory at a time), each on both workloads, repeats
alternating; the load average is recorded around every run. Writes ``precision.json``, ``precision.md`` and
``precision.png`` into ``--out``.

Example:
    python scripts/bench_cpu_precision.py --out profiles/cpu-decode-amd-epyc-2core
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path

import torch
from harness.common import cpu_seconds, log
from harness.common import parser as script_parser
from harness.decode_step import DecodeStepBench
from harness.run_metrics import run_metrics
from harness.system_base import BenchSettings, BenchSystem

from asyncbatch.bench.report import command_line, machine_info, write_json
from asyncbatch.bench.workloads import WorkItem, uniform_requests
from asyncbatch.model.cpu_features import choose_cpu_dtype, cpu_flags
from asyncbatch.model.loader import load_config, load_tokenizer, resolve_model_path
from asyncbatch.profiling.host_info import git_commit

PRECISIONS = ("float32", "bfloat16", "int8", "int4", "w8a8")
CHAT = "Name three rivers."


def precision_args(name: str) -> tuple[str, str | None]:
    """(dtype, quantization) of a precision name."""
    return (name, None) if name in ("float32", "bfloat16") else ("float32", name)


def measure_bandwidth(mib: int = 256, repeats: int = 7) -> dict:
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    moved = 2 * src.numel() * 4
    return {"bytes_per_copy": moved, "best_gb_s": moved / min(times) / 1e9,
            "median_gb_s": moved / statistics.median(times) / 1e9}


def step_sweep(model: str | None, precisions: list[str], rows: list[int], context: int, repeats: int,
               bandwidth_gb_s: float) -> list[dict]:
    out = []
    for name in precisions:
        dtype, quant = precision_args(name)
        log(f"step sweep: {name} ...")
        bench = DecodeStepBench(model, dtype, quant, max_rows=max(rows), context=context)
        wbytes = bench.weight_bytes()
        for r in rows:
            t = bench.time_steps(r, repeats=repeats, warmup=1)
            floor_ms = (wbytes + bench.kv_bytes(r)) / (bandwidth_gb_s * 1e9) * 1e3
            out.append({"precision": name, "rows": r, "step_ms_median": t.median_ms, "step_ms_min": t.min_ms,
                        "step_cpu_ms_median": t.cpu_median_ms,
                        "weights_mib": wbytes / 2**20, "kv_mib": bench.kv_bytes(r) / 2**20,
                        "floor_ms": floor_ms, "tokens_per_s": r / t.median_ms * 1e3,
                        "load_average": os.getloadavg()[0]})
            log(f"  {name:<8} {r:>4} rows: {t.median_ms:8.1f} ms, CPU {t.cpu_median_ms:8.1f} ms "
                f"(floor {floor_ms:6.1f} ms)")
        del bench
        gc.collect()
    return out


def build(kind: str, settings: BenchSettings) -> BenchSystem:
    if kind == "llama.cpp":
        from harness.system_llamacpp import LlamaCppSystem

        return LlamaCppSystem(settings)
    if kind == "transformers-generate_batch":
        from harness.system_hf_continuous import HFContinuousSystem

        return HFContinuousSystem(settings)
    from harness.system_asyncbatch import AsyncBatchSystem

    return AsyncBatchSystem(settings, overlap=True, name=f"asyncbatch {kind}")


def system_pids(system: BenchSystem) -> list[int]:
    """This process, and asyncbatch's engine-core process where the system has one."""
    client = getattr(getattr(system, "llm", None), "_client", None)
    core = getattr(getattr(client, "process", None), "pid", None)
    return [os.getpid()] + ([core] if core else [])


def run_system(kind: str, settings: BenchSettings, workloads: dict[str, list[WorkItem]], repeats: int,
               single: list[WorkItem]) -> dict:
    log(f"throughput: building {kind} ...")
    system = build(kind, settings)
    try:
        system.warmup([WorkItem(it.prompt_token_ids, min(it.max_tokens, 8)) for it in single + workloads[
            next(iter(workloads))][:4]])
        result: dict = {"system": kind, "config": system.config(), "workloads": {}}
        for rep in range(repeats):
            for wname, items in workloads.items():
                load0, cpu0 = os.getloadavg()[0], cpu_seconds(system_pids(system))
                run = system.run_offline(items)
                cpu_s = cpu_seconds(system_pids(system)) - cpu0
                m = run_metrics(run)
                entry = result["workloads"].setdefault(wname, {"runs": []})
                out_tokens = sum(r.output_len for r in run.requests)
                entry["runs"].append({"output_throughput": m["output_throughput"], "duration_s": m["duration_s"],
                                      "cpu_s": cpu_s, "output_tokens_per_cpu_s": out_tokens / cpu_s if cpu_s else None,
                                      "tpot_p50_ms": (m["tpot_ms"] or {}).get("p50"),
                                      "ttft_p50_ms": (m["ttft_ms"] or {}).get("p50"),
                                      "load_average": [load0, os.getloadavg()[0]],
                                      "first_tokens": [r.token_ids[:16] for r in run.requests[:4]]})
                log(f"  {kind:<28} {wname:<12} rep {rep + 1}: {m['output_throughput']:7.1f} out tok/s, "
                    f"{out_tokens / cpu_s if cpu_s else 0:7.1f} out tok/CPU-s, {m['duration_s']:6.1f} s, "
                    f"load {load0:.1f}")
        run = system.run_offline(single)
        rec = run.requests[0]
        decode_tps = (rec.output_len - 1) / (rec.finish - rec.first_token) if rec.output_len > 1 else None
        result["single"] = {"output_tokens": rec.output_len, "ttft_ms": 1e3 * (rec.first_token - rec.arrival),
                            "tok_per_s": rec.output_len / (rec.finish - rec.arrival), "decode_tok_per_s": decode_tps,
                            "token_ids": rec.token_ids}
        log(f"  {kind:<28} one request: {result['single']['tok_per_s']:.1f} tok/s "
            f"(decode {decode_tps or 0:.1f}), TTFT {result['single']['ttft_ms']:.0f} ms")
        for w in result["workloads"].values():
            w["output_throughput_median"] = statistics.median(r["output_throughput"] for r in w["runs"])
            per_cpu = [r["output_tokens_per_cpu_s"] for r in w["runs"] if r["output_tokens_per_cpu_s"]]
            w["output_tokens_per_cpu_s_median"] = statistics.median(per_cpu) if per_cpu else None
        return result
    finally:
        system.close()
        del system
        gc.collect()


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# CPU precisions side by side ({m['cpu']}, {m['cores']} cores, {m['capability']})", "",
             (f"Commit {doc['git_commit']}; torch {m['torch']}, {m['torch_threads']} torch threads; load average "
              f"{doc['load_average_start']} at the start, {doc['load_average_end']} at the end (1/5/15 min)."), "",
             f"`dtype=\"auto\"` here: {doc['auto_dtype']}.", "",
             f"Command: `{doc['command']}`", "",
             (f"Memory bandwidth (256 MiB copy, read + write): best {doc['bandwidth']['best_gb_s']:.1f} GB/s, "
              f"median {doc['bandwidth']['median_gb_s']:.1f} GB/s."), ""]
    if doc["throughput"]:
        wnames = list(doc["throughput"][0]["workloads"])
        lines += ["## Output tok/s (offline, greedy, ignore_eos; median of repeats)", "",
                  ("Each workload cell: output tok/s (wall clock) / output tokens per CPU-second of the system's "
                   "processes (asyncbatch: this process and its engine core). On a machine shared with other "
                   "jobs the second moves far less with their load; with one thread per system it is the "
                   "throughput one dedicated core would give, memory contention aside."), "",
                  "| system | " + " | ".join(wnames) + " | one request alone: tok/s (decode tok/s), TTFT |",
                  "|---|" + "---|" * len(wnames) + "---|"]
        for t in doc["throughput"]:
            cells = [f"{t['workloads'][w]['output_throughput_median']:.1f} / "
                     f"{t['workloads'][w]['output_tokens_per_cpu_s_median'] or 0:.1f}" for w in wnames]
            same = t.get("same_first_tokens_as_float32")
            cells[0] += "" if same is None else f" ({same})"
            s = t.get("single") or {}
            single = (f"{s['tok_per_s']:.1f} ({s['decode_tok_per_s'] or 0:.1f}), {s['ttft_ms']:.0f} ms" if s else "-")
            lines.append(f"| {t['system']} | " + " | ".join(cells) + f" | {single} |")
        lines += ["", "In brackets: of the first 16 greedy tokens of 4 requests, how many match asyncbatch float32's.", ""]
    for skipped in doc.get("skipped", []):
        lines.append(f"Skipped: {skipped}")
    lines += ["", (f"## Decode step time vs rows (context {doc['context']} tokens per row; median of "
                   f"{doc['step_repeats']} steps)"), "",
              "Each cell: wall ms / CPU ms of this process (all threads) / memory-traffic floor ms.", "",
              "| precision | weights read MiB | " + " | ".join(f"{r} rows" for r in doc["rows"]) + " |",
              "|---|---|" + "---|" * len(doc["rows"])]
    by = {}
    for s in doc["steps"]:
        by.setdefault(s["precision"], {})[s["rows"]] = s
    for name, per in by.items():
        first = next(iter(per.values()))
        cells = [f"{per[r]['step_ms_median']:.1f} / {per[r]['step_cpu_ms_median']:.1f} / {per[r]['floor_ms']:.1f}"
                 if r in per else "-" for r in doc["rows"]]
        lines.append(f"| {name} | {first['weights_mib']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    if doc["throughput"]:
        wnames = list(doc["throughput"][0]["workloads"])
        width = 0.8 / max(len(wnames), 1)
        for j, w in enumerate(wnames):
            vals = [t["workloads"][w]["output_throughput_median"] for t in doc["throughput"]]
            xs = [i + j * width for i in range(len(vals))]
            bars = ax1.bar(xs, vals, width, label=w)
            ax1.bar_label(bars, fmt="%.0f", fontsize=7)
        ax1.set_xticks([i + width * (len(wnames) - 1) / 2 for i in range(len(doc["throughput"]))])
        ax1.set_xticklabels([t["system"].replace("asyncbatch ", "ab ").replace("transformers-", "hf ")
                             for t in doc["throughput"]], rotation=30, ha="right", fontsize=8)
        ax1.set_ylabel("output tok/s")
        ax1.set_title("offline throughput, 32 requests")
        ax1.legend(fontsize=8)
    by: dict[str, list[dict]] = {}
    for s in doc["steps"]:
        by.setdefault(s["precision"], []).append(s)
    for name, pts in by.items():
        line, = ax2.plot([p["rows"] for p in pts], [p["step_ms_median"] for p in pts], marker="o", label=name)
        ax2.plot([p["rows"] for p in pts], [p["floor_ms"] for p in pts], linestyle=":", color=line.get_color())
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("decode rows")
    ax2.set_ylabel("step ms (dotted: memory-traffic floor)")
    ax2.set_title("decode step time vs rows")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores, {doc['machine']['capability']}; "
                 f"load avg {doc['load_average_start'][0]:.1f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="for the step sweep")
    parser.add_argument("--throughput-precisions", default=None,
                        help="asyncbatch precisions in the throughput runs (default: all but bfloat16 where the "
                             "CPU has no native bfloat16: there it is 5-7x slower than float32 per step)")
    parser.add_argument("--baselines", default="generate_batch,llamacpp")
    parser.add_argument("--rows", default="1,8,32,128")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--step-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of every system: torch's here and in asyncbatch's engine, llama.cpp's "
                             "(default: every core)")
    parser.add_argument("--repeats", type=int, default=1, help="throughput repeats per workload")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--no-sweep", action="store_true", help="throughput only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [int(x) for x in args.rows.split(",")]
    precisions = [p for p in args.precisions.split(",") if p]
    auto = choose_cpu_dtype()
    doc: dict = {"command": command_line(),
                 "git_commit": git_commit(), "load_average_start": [round(x, 2) for x in os.getloadavg()],
                 "machine": {**machine_info("cpu"), "capability": torch.backends.cpu.get_cpu_capability(),
                             "simd_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma",
                                                                                          "f16c")))},
                 "auto_dtype": auto.reason, "rows": rows, "context": args.context,
                 "step_repeats": args.step_repeats, "skipped": []}
    log("measuring memory bandwidth ...")
    doc["bandwidth"] = measure_bandwidth()
    doc["steps"] = [] if args.no_sweep else step_sweep(args.model, precisions, rows, args.context,
                                                       args.step_repeats, doc["bandwidth"]["best_gb_s"])
    doc["throughput"] = []
    if not args.no_throughput:
        path = resolve_model_path(args.model)
        vocab = int(load_config(path)[0].vocab_size)
        tokenizer = load_tokenizer(path)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], tokenize=False,
                                             add_generation_prompt=True)
        single = [WorkItem(tokenizer.encode(chat, add_special_tokens=False), 48)]
        workloads = {"32 x (64+128)": uniform_requests(32, (64, 64), (128, 128), vocab, seed=0),
                     "README 32": uniform_requests(32, (16, 128), (8, 128), vocab, seed=0)}
        default_tp = [p for p in precisions if p != "bfloat16" or auto.dtype == torch.bfloat16]
        tp = args.throughput_precisions.split(",") if args.throughput_precisions else default_tp
        if "bfloat16" in precisions and "bfloat16" not in tp:
            doc["skipped"].append("asyncbatch bfloat16 throughput: no native bfloat16 on this CPU (its step "
                                  "times are in the sweep below)")
        kinds = list(tp) + [{"generate_batch": "transformers-generate_batch", "llamacpp": "llama.cpp"}[b]
                            for b in args.baselines.split(",") if b]
        for kind in kinds:
            dtype, quant = precision_args(kind) if kind in PRECISIONS else ("float32", None)
            settings = BenchSettings(model=args.model, device="cpu", dtype=dtype, quantization=quant,
                                     max_num_seqs=256, max_num_batched_tokens=2048, num_threads=args.threads)
            try:
                doc["throughput"].append(run_system(kind, settings, workloads, args.repeats, single))
            except Exception as exc:  # an optional baseline that cannot be built is reported
                if kind != "llama.cpp":
                    raise
                doc["skipped"].append(f"llama.cpp: {exc}")
                log(f"skipping llama.cpp: {exc}")
    ref = next((t for t in doc["throughput"] if t["system"] == "float32"), None)
    for t in doc["throughput"]:
        if ref is not None and t is not ref:
            w = next(iter(t["workloads"]))
            a, b = ref["workloads"][w]["runs"][0]["first_tokens"], t["workloads"][w]["runs"][0]["first_tokens"]
            same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
            t["same_first_tokens_as_float32"] = f"{same}/{sum(len(r) for r in a)}"
    doc["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(doc, out / "precision.json", nan_as_null=True)
    text = markdown(doc)
    (out / "precision.md").write_text(text)
    plot(doc, out / "precision.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
