"""``python -m asyncbatch.bench --base-url URL --out DIR``: the serving benchmark against a running server.

Replays a workload (``--workload``, ``--num-prompts`` per load point) over HTTP, streaming, at every
load point (``--request-rates``: Poisson, or bursty with ``--burstiness`` < 1; ``--max-concurrency``
caps requests in flight), and reports throughput, goodput under the ``--slo-*`` SLO, TTFT, TPOT, ITL
and end-to-end latency (mean, P50, P90, P99), and device busy from asyncbatch's /metrics as
``<tag>.json`` and ``<tag>.md`` under ``--out``. Start the server first, e.g.
``asyncbatch serve --device sim``. To start asyncbatch serve and transformers serve one after the
other and compare them (with plots): ``scripts/bench_serving.py``.
"""

from __future__ import annotations

import argparse

from asyncbatch.bench.serving_script import add_arguments, command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncbatch.bench", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.base_url:
        parser.error("--base-url is required (the URL of a running OpenAI-compatible server)")
    return command(parser, args)


if __name__ == "__main__":
    raise SystemExit(main())
