"""Benchmark helpers behind ``scripts/bench_throughput.py`` and ``scripts/bench_latency.py``.

One concept per module:

- ``records``: what a run measured (per-request timestamps and tokens);
- ``metrics``: numbers from records (TTFT, TPOT, ITL, throughput), medians over repeats;
- ``memory`` / ``host_load``: a system's memory, and how much of the CPUs other processes took;
- ``arrivals``: Poisson and gamma (bursty) arrival times;
- ``system_base``: the interface and shared settings; ``system_asyncbatch``,
  ``system_hf_continuous``, ``system_hf_static`` (+ ``hf_common``): the systems; ``systems``: the registry;
- ``runner``: repeats, progress bar, correctness check; ``script``: the scripts' common body;
- ``report``: the JSON document and tables; ``schema``: its schema and validator; ``plots``: PNGs.

Workloads live in ``asyncbatch.bench.workloads``.
"""
