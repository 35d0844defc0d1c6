"""The serving benchmark's body: requests, the servers under test one after the other, report files.

``python -m asyncbatch.bench`` runs it against a server that is already running (``--base-url``);
``scripts/bench_serving.py`` passes ``servers`` that start asyncbatch serve and its peers itself
(``scripts/harness/serving_peers.py``) and a ``plot``.

Writes into ``--out``: ``<tag>.json`` (validated against ``schema.SERVING_SCHEMA``), ``<tag>.md`` (the
side-by-side tables), the plot's PNG when one is given, and each started server's log under ``logs/``.
A server that fails to start is reported (its entry has ``error`` and no points) and the others still
run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncbatch.bench.arrivals import parse_rates
from asyncbatch.bench.serving_client import (
    DIALECTS,
    ENDPOINTS,
    TRANSFORMERS,
    ClientOptions,
    Dialect,
    ServingRequest,
    served_model,
)
from asyncbatch.bench.serving_metrics import SLO
from asyncbatch.bench.serving_report import (
    build_document,
    markdown_report,
    terminal_table,
    write_serving_json,
)
from asyncbatch.bench.serving_runner import (
    RunPlan,
    load_points,
    point_requests,
    run_system,
    stderr_log,
    warmup_requests,
)
from asyncbatch.bench.workloads import WORKLOADS, build_workload, describe, parse_range, sharegpt_params
from asyncbatch.model.loader import load_config, load_tokenizer, resolve_model_path

# Draws ``<tag>_latency_vs_load.png`` from the document at the path given; returns that path.
Plot = Callable[[dict, Path], Path]


@dataclass(frozen=True)
class Servers:
    """Servers the benchmark starts itself, one after the other (``--systems``).

    ``dialects``: each one's request extras, in order; ``run(name, args, model_path, plan, out, systems)``
    starts one, measures every load point, stops it, and appends its entry to ``systems``.
    """

    names: list[str]
    dialects: list[Dialect]
    run: Callable[[str, argparse.Namespace, Path, RunPlan, Path, list[dict]], None]


class UsageError(ValueError):
    """A mistake in the command line (the script prints it in one line and exits 2)."""


def parse_concurrency(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        caps = []
    if not caps or any(c < 1 for c in caps):
        raise UsageError(f"--max-concurrency must be a comma list of integers >= 1, got {text!r}")
    return caps


def choose_prompt_format(requested: str, dialects: list[Dialect], endpoint: str) -> str:
    """``token-ids`` when every server takes them (exact lengths), else text, which every server takes."""
    takes_ids = endpoint == "completions" and all(d.token_id_prompts for d in dialects)
    if requested == "auto":
        return "token-ids" if takes_ids else "text"
    if requested == "token-ids" and not takes_ids:
        raise UsageError("--prompt-format token-ids: a server here takes text prompts only "
                         f"({', '.join(d.name for d in dialects if not d.token_id_prompts) or 'chat endpoint'})")
    return requested


def build_requests(args: argparse.Namespace, model_path: Path, prompt_format: str, total: int) -> tuple[
        list[ServingRequest], dict]:
    """``total`` requests of the workload, as token ids or as their decoded text; and the workload's doc."""
    hf_config, _ = load_config(model_path)
    items = build_workload(args.workload, total, int(hf_config.vocab_size), seed=args.seed,
                           input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                           prompt_range=parse_range(args.prompt_range), output_range=parse_range(args.output_range))
    doc = {"name": args.workload, "seed": args.seed, "params": _workload_params(args), **describe(items)}
    if prompt_format == "token-ids":
        return [ServingRequest(list(it.prompt_token_ids), it.max_tokens, len(it.prompt_token_ids)) for it in items], doc
    tokenizer = load_tokenizer(model_path)
    texts = [tokenizer.decode(it.prompt_token_ids, skip_special_tokens=True) for it in items]
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise UsageError(f"the tokenizer decodes {len(empty)} workload prompts (e.g. #{empty[0]}) to empty text; "
                         "use --prompt-format token-ids with servers that take token ids")
    # Decoding random ids and encoding the text again gives a few percent more tokens; the servers'
    # own counts (usage) are what the report's token figures use.
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    doc["text_prompt_tokens"] = sum(lengths)
    doc["text_prompt_len_mean"] = sum(lengths) / len(lengths)
    return [ServingRequest(t, it.max_tokens, n) for t, it, n in zip(texts, items, lengths)], doc


def _workload_params(args: argparse.Namespace) -> dict:
    if args.workload == "uniform":
        return {"prompt_range": list(parse_range(args.prompt_range)),
                "output_range": list(parse_range(args.output_range))}
    if args.workload == "random":
        return {"input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio}
    if args.workload == "sharegpt":
        return sharegpt_params()
    return {"source": "nano-vllm bench.py"}


def system_entry(name: str, description: str, dialect: Dialect, base_url: str, command: list[str] | None,
                  log: Path | None, config: dict | None = None) -> dict:
    return {"name": name, "description": description, "dialect": dialect.name, "base_url": base_url,
            "command": command, "log": None if log is None else str(log), "config": config or {},
            "served_model": None, "ready_s": None, "exit_code": None, "error": None, "warmup": None, "points": []}


def run_external(args: argparse.Namespace, plan: RunPlan, systems: list[dict]) -> None:
    dialect = DIALECTS[args.base_url_dialect]
    entry = system_entry(args.base_url_name, f"already running server at {args.base_url}", dialect,
                          args.base_url, None, None)
    systems.append(entry)
    entry["served_model"] = args.served_model or served_model(args.base_url)
    run_system(entry, args.base_url, entry["served_model"], dialect, plan, stderr_log)


def write_report(args: argparse.Namespace, out: Path, settings: dict, workload: dict, plan: RunPlan,
                 systems: list[dict], prompt_format: str, plot: Plot | None = None) -> dict:
    doc = build_document(settings, workload, [p.as_dict() for p in plan.points], systems,
                         notes_for(args, systems, prompt_format))
    png = out / f"{args.tag}_latency_vs_load.png"
    if plot is not None and any(s["points"] for s in systems):
        doc["plots"] = [plot(doc, png).name]
    json_path = write_serving_json(doc, out / f"{args.tag}.json")
    (out / f"{args.tag}.md").write_text(markdown_report(doc) + "\n")
    print(terminal_table(doc), flush=True)
    stderr_log(f"wrote {json_path}, {args.tag}.md{''.join(', ' + p for p in doc['plots'])}")
    return doc


def notes_for(args: argparse.Namespace, systems: list[dict], prompt_format: str) -> list[str]:
    notes: list[str] = []
    if args.device == "sim":
        notes.append("SIMULATED device: asyncbatch's device time is its cost model (sim), not a GPU; the HTTP "
                     "server, tokenizer, planner and client are real")
    dialects = {s["dialect"] for s in systems}
    if prompt_format == "text":
        why = (" because transformers serve takes string prompts only (token ids: HTTP 400 'prompt must be a "
               "string.')" if TRANSFORMERS.name in dialects else "")
        notes.append(f"prompts sent as text (the workload's token ids decoded with the model's tokenizer){why}; "
                     "each server tokenizes them; prompt token figures are the servers' own (usage)")
    if TRANSFORMERS.name in dialects and not args.base_url:
        setting = {"workload": "sized for the workload (every request of a load point in flight at full length)",
                   "match": "matched to asyncbatch's capacity in tokens",
                   "auto": "sized by transformers itself from free memory"}[args.transformers_kv_cache]
        notes.append(f"transformers serve's KV cache: {setting}; on CPU its steps slow down with the cache's size "
                     "(see scripts/harness/serving_servers.py), so 'match' measures that, not the server")
    if args.ignore_eos and TRANSFORMERS.name in dialects:
        notes.append("transformers serve rejects vLLM's ignore_eos (HTTP 422 'Unexpected fields'); it got a "
                     "generation_config request field with eos_token_id -1 instead (its continuous batching "
                     "then never stops at EOS)")
    for s in systems:
        if s.get("error"):
            notes.append(f"{s['name']} failed: {s['error']}")
        sums = [p["summary"] for p in s["points"]]
        short = sum(x["outputs_not_max_tokens"] for x in sums)
        done = sum(x["completed"] for x in sums)
        if sums and short:
            notes.append(f"{s['name']}: {short} of {done} completed requests returned a number of output tokens "
                         "other than max_tokens (counted as returned)")
        if sums and sum(x["output_tokens_from_usage"] for x in sums) < done:
            notes.append(f"{s['name']}: some streams reported no usage; their output tokens are counted by chunks")
        if sums and sum(x["streams_with_done"] for x in sums) == 0 and done:
            notes.append(f"{s['name']}: streams end without 'data: [DONE]' (a finish_reason chunk ends them)")
        blank = sum(x["completed_without_text"] for x in sums)
        if blank:
            notes.append(f"{s['name']}: {blank} completed requests streamed no visible text; their tokens are "
                         "timed at the last chunk")
        failed = sum(x["failed"] for x in sums)
        if failed:
            notes.append(f"{s['name']}: {failed} requests failed (see failure_reasons per point)")
        if sums and not any(p["server"].get("available") for p in s["points"]):
            notes.append(f"{s['name']}: no device-busy figure ({s['points'][0]['server'].get('note')})")
    return notes


def run(args: argparse.Namespace, servers: Servers | None = None, plot: Plot | None = None) -> int:
    """Run the benchmark the arguments describe against ``--base-url``, else against ``servers``;
    returns the exit status."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        rates = parse_rates(args.request_rates) if args.request_rates else [math.inf]
        parse_range(args.prompt_range), parse_range(args.output_range)
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    points = load_points(rates, parse_concurrency(args.max_concurrency))
    if not args.base_url and servers is None:
        raise UsageError("--base-url is required (scripts/bench_serving.py starts servers itself)")
    names = [] if args.base_url else servers.names
    dialects = [DIALECTS[args.base_url_dialect]] if args.base_url else servers.dialects
    prompt_format = choose_prompt_format(args.prompt_format, dialects, args.endpoint)
    model_path = resolve_model_path(args.model)
    warm_n = max(args.warmup_requests, 0)
    requests, workload = build_requests(args, model_path, prompt_format, args.num_prompts * len(points) + warm_n)
    slices, rest = point_requests(requests, args.num_prompts, len(points))
    options = ClientOptions(args.endpoint, args.temperature, args.ignore_eos, args.request_timeout, args.api_key)
    plan = RunPlan(points, slices, warmup_requests(rest, warm_n), options, slo, args.burstiness, args.seed,
                   args.metrics_interval)
    stderr_log(f"serving: {len(points)} load points x {args.num_prompts} prompts ({args.workload}, {prompt_format}), "
               f"model {model_path}, {args.device}/{args.dtype}, systems {names or [args.base_url]}")
    settings = {"model_path": str(model_path), "device": args.device, "dtype": args.dtype,
                "temperature": args.temperature, "ignore_eos": args.ignore_eos, "slo": slo.as_dict(),
                "prompt_format": prompt_format, "endpoint": args.endpoint, "num_prompts": args.num_prompts,
                "burstiness": args.burstiness, "seed": args.seed, "warmup_requests": warm_n,
                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                "request_timeout_s": args.request_timeout, "metrics_interval_s": args.metrics_interval,
                "torch_threads": getattr(args, "torch_threads", None)}
    systems: list[dict] = []
    try:
        if args.base_url:
            run_external(args, plan, systems)
        for name in names:
            servers.run(name, args, model_path, plan, out, systems)
    except (KeyboardInterrupt, SystemExit) as exc:
        # Ctrl-C or SIGTERM (made SystemExit by the script): the servers are down; keep what was measured.
        for entry in systems:
            if len(entry["points"]) < len(plan.points) and entry["error"] is None:
                entry["error"] = f"interrupted ({type(exc).__name__}) after {len(entry['points'])} load points"
        write_report(args, out, settings, workload, plan, systems, prompt_format, plot)
        raise
    write_report(args, out, settings, workload, plan, systems, prompt_format, plot)
    return 1 if any(s.get("error") for s in systems) else 0


def add_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The options of every serving run; returns the ``servers`` group, for a script's own server options."""
    target = p.add_argument_group("servers")
    target.add_argument("--base-url", default=None, help="benchmark this running server (e.g. http://127.0.0.1:8000)")
    target.add_argument("--base-url-name", default="server", help="its name in the report")
    target.add_argument("--base-url-dialect", default="vllm", choices=sorted(DIALECTS),
                        help="its request extras: vllm (ignore_eos, token-id prompts), transformers, openai")
    target.add_argument("--served-model", default=None, help="model name to request (default: /v1/models' first)")
    target.add_argument("--model", default=None, help="model path, for the workload's tokenizer and vocabulary "
                                                      "(default: asyncbatch's SmolLM2-135M)")
    target.add_argument("--device", default="cpu", choices=("cpu", "cuda", "sim", "auto"))
    target.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"))
    target.add_argument("--max-num-seqs", type=int, default=256)
    target.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="per step; transformers gets it as --cb-max-batch-tokens")
    target.add_argument("--api-key", default=None)

    load = p.add_argument_group("load")
    load.add_argument("--request-rates", default="1,2,4", help="comma list of req/s; inf = all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier")
    load.add_argument("--max-concurrency", default=None, help="comma list of caps on requests in flight")
    load.add_argument("--num-prompts", type=int, default=32, help="requests per load point")
    load.add_argument("--warmup-requests", type=int, default=4)
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    load.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics samples")

    work = p.add_argument_group("requests")
    work.add_argument("--workload", default="uniform", choices=WORKLOADS)
    work.add_argument("--prompt-range", default="16,128", help="uniform workload: inclusive prompt length range")
    work.add_argument("--output-range", default="16,64", help="uniform workload: inclusive output length range")
    work.add_argument("--input-len", type=int, default=128, help="random workload: mean prompt length")
    work.add_argument("--output-len", type=int, default=64, help="random workload: mean output length")
    work.add_argument("--range-ratio", type=float, default=0.0, help="random workload: lengths in len*(1±r)")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--endpoint", default="completions", choices=sorted(ENDPOINTS))
    work.add_argument("--prompt-format", default="auto", choices=("auto", "text", "token-ids"),
                      help="auto: token ids when every server takes them, else text decoded from them")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--honor-eos", dest="ignore_eos", action="store_false",
                      help="let outputs stop at EOS (default: ask every server for exactly max_tokens)")

    report = p.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    report.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    report.add_argument("--out", required=True, help="directory for the JSON, Markdown, PNG and server logs")
    report.add_argument("--tag", default="serving", help="file name prefix of the outputs")
    return target


def command(parser: argparse.ArgumentParser, args: argparse.Namespace,
            servers: Callable[[argparse.Namespace], Servers] | None = None, plot: Plot | None = None) -> int:
    """``run`` for a command line: ``servers(args)`` unless ``--base-url``; a mistake the user can fix
    prints one line naming it and returns 2."""
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    try:
        return run(args, None if args.base_url or servers is None else servers(args), plot)
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
