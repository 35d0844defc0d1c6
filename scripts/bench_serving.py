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
from pathlib import Path

from harness import plots
from harness.common import parser as script_parser
from harness.serving_peers import add_server_arguments, render, servers

from asyncbatch.bench.serving_script import add_arguments, command


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    add_server_arguments(add_arguments(p))
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only redraw <tag>.md and the PNG under --out from this results JSON")
    return p


def _terminate(signum: int, _frame: object) -> None:
    # SIGTERM becomes SystemExit so that the servers' `with` blocks stop them on the way out.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.render:
        render(Path(args.render), Path(args.out), args.tag)
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    return command(parser, args, servers, plots.latency_vs_load)


if __name__ == "__main__":
    raise SystemExit(main())
