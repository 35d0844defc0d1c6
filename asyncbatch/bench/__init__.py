"""Benchmark helpers behind ``scripts/bench_throughput.py`` and ``scripts/bench_latency.py``.

One concept per module: ``records`` (what a run measured), ``metrics`` (numbers
from records, and medians over repeats), ``memory`` (peak resident memory),
``arrivals`` (request arrival processes), ``system_*`` (asyncbatch and the
transformers baselines behind one interface), ``systems`` (the registry),
``runner`` (repeats, progress bar, correctness check), ``report`` (terminal
table and JSON), ``schema`` (the JSON's schema and its validator), ``plots``.
Workloads live in ``asyncbatch.workloads``.
"""
