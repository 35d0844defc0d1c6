"""The servers ``bench_serving.py`` starts itself: asyncbatch serve and transformers serve, one after the other.

``servers(args)`` gives the package's serving benchmark (``asyncbatch.bench.serving_script``) the
``Servers`` to run; ``render`` redraws a report's Markdown and PNG from its JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from asyncbatch.bench.serving_client import TRANSFORMERS, VLLM
from asyncbatch.bench.serving_report import markdown_report, terminal_table
from asyncbatch.bench.serving_runner import RunPlan, run_system, stderr_log
from asyncbatch.bench.serving_script import Servers, UsageError, system_entry
from harness import plots
from harness.serving_servers import (
    ManagedServer,
    ServerSpec,
    ServerStartError,
    asyncbatch_spec,
    kv_capacity_tokens,
    transformers_spec,
    workload_kv_tokens,
)

SYSTEMS = ("asyncbatch", "transformers")


def parse_systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if not names or unknown or len(set(names)) != len(names):
        raise UsageError(f"--systems must be a comma list of distinct names from {SYSTEMS}, got {text!r}")
    return names


def transformers_kv_tokens(args: argparse.Namespace, model_path: Path, plan: RunPlan) -> int | None:
    """``--transformers-kv-cache``: workload (every request of a point at once), match (asyncbatch's
    capacity) or auto (None: transformers sizes it from free memory)."""
    if args.transformers_kv_cache == "workload":
        return workload_kv_tokens(plan.requests)
    if args.transformers_kv_cache == "match":
        return kv_capacity_tokens(str(model_path), args.device, args.dtype, args.max_num_seqs,
                                  args.max_num_batched_tokens)
    return None


def server_spec(name: str, args: argparse.Namespace, model_path: Path, plan: RunPlan) -> ServerSpec:
    extra = shlex.split(getattr(args, f"{name}_args") or "")
    if name == "asyncbatch":
        if args.api_key:
            extra += ["--api-key", args.api_key]
        return asyncbatch_spec(str(model_path), args.device, args.dtype, args.max_num_seqs,
                               args.max_num_batched_tokens, args.seed, extra, torch_threads=args.torch_threads)
    kv_tokens = transformers_kv_tokens(args, model_path, plan)
    return transformers_spec(str(model_path), args.device, args.dtype, args.max_num_batched_tokens, kv_tokens, extra,
                             torch_threads=args.torch_threads)


def server_config(name: str, args: argparse.Namespace, model_path: Path, plan: RunPlan) -> dict:
    """The limits a server runs with, as the report states them (KV capacity in tokens included)."""
    config = {"max_num_batched_tokens": args.max_num_batched_tokens, "torch_threads": args.torch_threads}
    if name == "asyncbatch":
        capacity = kv_capacity_tokens(str(model_path), args.device, args.dtype, args.max_num_seqs,
                                      args.max_num_batched_tokens)
        return {**config, "max_num_seqs": args.max_num_seqs, "kv_cache_tokens": capacity}
    return {**config, "kv_cache": args.transformers_kv_cache,
            "kv_cache_tokens": transformers_kv_tokens(args, model_path, plan)}


def run_managed(name: str, args: argparse.Namespace, model_path: Path, plan: RunPlan, out: Path,
                systems: list[dict]) -> None:
    """Start the server, run every point against it, stop it; its entry joins ``systems`` at once."""
    spec = server_spec(name, args, model_path, plan)
    log_path = out / "logs" / f"{args.tag}_{name}.log"
    entry = system_entry(name, spec.description, spec.dialect, spec.base_url, spec.argv, log_path,
                          server_config(name, args, model_path, plan))
    systems.append(entry)
    stderr_log(f"{name}: starting {shlex.join(spec.argv)}")
    server = ManagedServer(spec, log_path, startup_timeout_s=args.startup_timeout)
    try:
        with server:
            entry["ready_s"] = server.ready_s
            entry["served_model"] = server.served_model()
            stderr_log(f"{name}: ready in {server.ready_s:.1f} s at {spec.base_url}, model {entry['served_model']!r}")
            run_system(entry, spec.base_url, entry["served_model"], spec.dialect, plan, stderr_log, server.pgid)
    except ServerStartError as exc:
        entry["error"] = str(exc).splitlines()[0]
        stderr_log(f"{name}: {exc}")
    finally:
        entry["exit_code"] = server.returncode


def render(path: Path, out: Path, tag: str) -> dict:
    """The Markdown and the PNG again from a results JSON (they read nothing else), e.g. after a change
    to how they are drawn."""
    doc = json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    if any(s["points"] for s in doc["systems"]):
        doc["plots"] = [plots.latency_vs_load(doc, out / f"{tag}_latency_vs_load.png").name]
    (out / f"{tag}.md").write_text(markdown_report(doc) + "\n")
    print(terminal_table(doc), flush=True)
    return doc


def servers(args: argparse.Namespace) -> Servers:
    """``--systems`` as the package's serving benchmark runs them (checked against ``--device``)."""
    names = parse_systems(args.systems)
    if args.device == "sim" and "transformers" in names:
        raise UsageError("transformers serve cannot run on the simulated device: use --systems asyncbatch")
    return Servers(names, [VLLM if n == "asyncbatch" else TRANSFORMERS for n in names], run_managed)


def add_server_arguments(target: argparse._ArgumentGroup) -> None:
    """The options of the servers this module starts (``target``: the package's ``servers`` group)."""
    target.add_argument("--systems", default="asyncbatch,transformers",
                        help="servers to start, one after the other: asyncbatch, transformers")
    target.add_argument("--asyncbatch-args", default="", help="extra arguments for asyncbatch serve (one string)")
    target.add_argument("--transformers-args", default="", help="extra arguments for transformers serve")
    target.add_argument("--transformers-kv-cache", default="workload", choices=("workload", "match", "auto"),
                        help="transformers' KV cache: sized for the workload, asyncbatch's capacity, or its own "
                             "choice from free memory (see scripts/harness/serving_servers.py)")
    target.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads of every server (OMP_NUM_THREADS; asyncbatch also gets "
                             "--num-threads); default: each server's own choice (all cores)")
    target.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to be ready")
