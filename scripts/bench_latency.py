#!/usr/bin/env python
"""Online latency: requests arrive by a Poisson (or bursty gamma) process; streaming callers time every token.

Each request is consumed as a stream (asyncbatch: ``LLM.stream`` in its own
thread; transformers continuous batching: ``add_request(streaming=True)``;
static batching: a server taking up to a batch of the arrived requests when
free). For every rate in ``--request-rates`` ("inf" = all at once) and every
repeat, all systems see the same requests at the same arrival times. Reports
TTFT, TPOT, ITL and end-to-end latency (mean, P50, P90, P99), throughput per
rate, and plots throughput versus rate and latency CDFs.

Example:
    python scripts/bench_latency.py --workload uniform --num-requests 32 \\
        --request-rates 0.5,1,2,inf --burstiness 1.0 --results-dir /tmp/lat
"""

from __future__ import annotations

from harness.common import parser as script_parser
from harness.runner import add_common_args
from harness.script import run

from asyncbatch.bench.arrivals import parse_rates


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    add_common_args(parser)
    parser.add_argument("--request-rates", default="1,2,4,inf", help="comma list of req/s; inf = all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    parser.add_argument("--honor-eos", action="store_true", help="stop at EOS (default: ignore EOS, equal work)")
    parser.add_argument("--tag", default="latency", help="file name prefix of the outputs")
    args = parser.parse_args(argv)
    run("latency", args, rates=parse_rates(args.request_rates), ignore_eos=not args.honor_eos,
        burstiness=args.burstiness)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
