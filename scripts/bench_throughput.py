#!/usr/bin/env python
"""Offline throughput: every request submitted at once, each system on the same requests, repeated.

Systems (``--systems``): asyncbatch overlap and synchronous, transformers'
continuous batching (``generate_batch``'s manager, per-request
``max_new_tokens``) and padded static batching with ``generate``; same model,
dtype, device, greedy sampling, ``ignore_eos``. Reports medians and min-max
over ``--repeats`` as a terminal table, ``<tag>.json``, ``<tag>_table.md`` and PNG
plots under ``--results-dir``.

Examples:
    python scripts/bench_throughput.py --workload uniform --num-requests 32 \\
        --prompt-range 16,128 --output-range 8,128 --results-dir profiles/bench-cpu
    python scripts/bench_throughput.py --workload nanovllm --num-requests 32 --results-dir /tmp/nano
    python scripts/bench_throughput.py --workload random --input-len 512 --output-len 128 \\
        --range-ratio 0.5 --systems overlap,generate_batch --results-dir /tmp/rand
"""

from __future__ import annotations

from harness.common import parser as script_parser
from harness.runner import add_common_args
from harness.script import run


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    add_common_args(parser)
    parser.add_argument("--tag", default="throughput", help="file name prefix of the outputs")
    args = parser.parse_args(argv)
    run("throughput", args, rates=[None], ignore_eos=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
