#!/usr/bin/env python
"""Serving benchmark: replays a workload against OpenAI-compatible servers over HTTP, streaming.

Starts each server of ``--systems`` in turn (asyncbatch serve, then transformers serve
--continuous-batching: same model directory, dtype and machine, on a free loopback port), warms it
up, and at every load point (``--request-rates``, Poisson or, with ``--burstiness`` < 1, bursty
arrivals; optionally capped at ``--max-concurrency`` requests in flight) sends ``--num-prompts``
streaming requests; or benchmarks one server that is already running (``--base-url``). Reports
request and output-token throughput, goodput under the ``--slo-ttft-ms``/``--slo-tpot-ms`` SLO, TTFT,
TPOT, ITL and end-to-end latency (mean, P50, P90, P99), device busy from asyncbatch's /metrics, and
asyncbatch / peer ratios, as ``<tag>.json``, ``<tag>.md`` and ``<tag>_latency_vs_load.png`` under
``--out``.

Examples:
    python scripts/bench_serving.py --workload uniform --prompt-range 16,128 --output-range 16,64 \\
        --num-prompts 32 --request-rates 0.5,1,2 --out results/serving
    python scripts/bench_serving.py --systems asyncbatch --device sim --num-prompts 1024 \\
        --request-rates inf --workload uniform --output-range 256,512 --out results/serving-sim --tag sim
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --base-url-dialect vllm \\
        --request-rates 4 --out /tmp/serving
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from asyncbatch.bench.serving_client import DIALECTS, ENDPOINTS
from asyncbatch.bench.serving_script import UsageError, render, run
from asyncbatch.bench.workloads import WORKLOADS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    target = p.add_argument_group("servers")
    target.add_argument("--systems", default="asyncbatch,transformers",
                        help="servers to start, one after the other: asyncbatch, transformers")
    target.add_argument("--base-url", default=None, help="benchmark this running server instead of starting any")
    target.add_argument("--base-url-name", default="server", help="its name in the report")
    target.add_argument("--base-url-dialect", default="vllm", choices=sorted(DIALECTS),
                        help="its request extras: vllm (ignore_eos, token-id prompts), transformers, openai")
    target.add_argument("--served-model", default=None, help="model name to request (default: /v1/models' first)")
    target.add_argument("--model", default=None, help="model path (default: asyncbatch's SmolLM2-135M)")
    target.add_argument("--device", default="cpu", choices=("cpu", "cuda", "sim", "auto"))
    target.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"))
    target.add_argument("--max-num-seqs", type=int, default=256)
    target.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="per step; transformers gets it as --cb-max-batch-tokens")
    target.add_argument("--asyncbatch-args", default="", help="extra arguments for asyncbatch serve (one string)")
    target.add_argument("--transformers-args", default="", help="extra arguments for transformers serve")
    target.add_argument("--transformers-kv-cache", default="workload", choices=("workload", "match", "auto"),
                        help="transformers' KV cache: sized for the workload, asyncbatch's capacity, or its own "
                             "choice from free memory (see asyncbatch/bench/serving_servers.py)")
    target.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads of every server (OMP_NUM_THREADS; asyncbatch also gets "
                             "--num-threads); default: each server's own choice (all cores)")
    target.add_argument("--api-key", default=None)
    target.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to be ready")

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
    report.add_argument("--render", default=None, metavar="JSON",
                        help="only redraw <tag>.md and the PNG under --out from this results JSON")
    return p


def _terminate(signum: int, _frame: object) -> None:
    # SIGTERM becomes SystemExit so that the servers' `with` blocks stop them on the way out.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.render:
        render(Path(args.render), Path(args.out), args.tag)
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args)
    except UsageError as exc:
        print(f"bench_serving.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
