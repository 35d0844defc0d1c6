"""The common body of the benchmark scripts: workload, systems, runs, table, JSON and plots.

Writes into ``--results-dir``: ``<tag>.json`` (validated against
``results_schema.RESULTS_SCHEMA``), ``<tag>_table.md`` and the PNG plots the document
lists under ``plots``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from asyncbatch.bench.workloads import build_workload, describe, parse_range, prefix_share, sharegpt_params
from asyncbatch.model.loader import load_config, resolve_model_path
from harness import plots
from harness.common import log as _log
from harness.report import build_document, markdown_table, table, write_results
from harness.runner import (
    build_systems,
    correctness,
    rate_key,
    run_all,
    settings_from_args,
    warmup_items,
)


def workload_doc(args: argparse.Namespace, items: list) -> dict:
    params: dict = {}
    if args.workload == "uniform":
        params = {"prompt_range": list(parse_range(args.prompt_range)),
                  "output_range": list(parse_range(args.output_range))}
    elif args.workload == "random":
        params = {"input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio}
    elif args.workload == "sharegpt":
        params = sharegpt_params()
    elif args.workload in ("shared_prefix", "multiturn"):
        params = {"system_len": args.system_len, "question_len": args.question_len, "output_len": args.output_len,
                  **({"turns": args.turns, "reply_len": args.output_len} if args.workload == "multiturn" else {}),
                  "prefix_share": prefix_share(items)}
    elif args.workload == "nanovllm":
        params = {"source": "nano-vllm bench.py (random.seed(0), 256 requests, lengths 100-1024)",
                  "full_size": 256, "published_output_tokens": 133966, "published_prompt_tokens": 142827}
    return {"name": args.workload, "seed": args.seed, "params": params, **describe(items)}


def run(kind: str, args: argparse.Namespace, rates: list[float | None], ignore_eos: bool,
        burstiness: float = 1.0) -> dict:
    """Run the benchmark the arguments describe; returns the document it wrote."""
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    path = resolve_model_path(args.model)
    hf_config, _ = load_config(path)
    n = args.num_requests if args.num_requests is not None else (256 if args.workload == "nanovllm" else 64)
    items = build_workload(args.workload, n, int(hf_config.vocab_size), seed=args.seed, input_len=args.input_len,
                           output_len=args.output_len, range_ratio=args.range_ratio,
                           prompt_range=parse_range(args.prompt_range),
                           output_range=parse_range(args.output_range), system_len=args.system_len,
                           question_len=args.question_len, turns=args.turns)
    settings = settings_from_args(args, ignore_eos)
    _log(f"{kind}: {n} requests ({args.workload}), model {path}, {args.device}/{args.dtype}, "
         f"{args.repeats} repeats, rates {rates}")
    systems = build_systems(args.systems, settings, warmup_items(items, args.warmup_requests), log=_log)
    if not systems:
        raise SystemExit("no system could be built")
    try:
        results = run_all(systems, items, rates, args.repeats, burstiness, args.seed, progress=not args.no_progress)
    finally:
        for system in systems:
            system.close()
    settings_doc = {**settings.as_dict(), "model_path": str(path), "repeats": args.repeats,
                    "warmup_requests": args.warmup_requests, "burstiness": burstiness}
    doc = build_document(kind, settings_doc, workload_doc(args, items), results, rates,
                         correctness(results, greedy=args.temperature == 0))
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag
    if kind == "throughput":
        drawn = [plots.throughput_bars(doc, out_dir / f"{tag}_throughput.png"),
                 plots.latency_cdfs(doc, out_dir / f"{tag}_latency_cdf.png")]
    else:
        finite = [r for r in rates if r is not None and not math.isinf(r)]
        cdf_rate = max(finite) if finite else rates[-1]
        drawn = [plots.throughput_vs_rate(doc, out_dir / f"{tag}_throughput_vs_rate.png"),
                 plots.latency_cdfs(doc, out_dir / f"{tag}_latency_cdf.png", rate=rate_key(cdf_rate))]
    doc["plots"] = [p.name for p in drawn]
    json_path = write_results(doc, out_dir, f"{tag}.json")
    text = table(doc)
    (out_dir / f"{tag}_table.md").write_text(markdown_table(doc) + "\n")
    print(text)
    _log(f"wrote {json_path} and {', '.join(doc['plots'])}")
    return doc

