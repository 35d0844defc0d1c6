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

Behind ``scripts/bench_serving.py`` (servers over HTTP):

- ``serving_client``: the async streaming client and its per-request records; ``serving_metrics``:
  throughput, goodput under an SLO, latency percentiles; ``serving_prometheus``: the server's /metrics
  (device busy, running requests); ``serving_servers``: asyncbatch serve and transformers serve as
  subprocesses; ``serving_runner``: warm-up and load points against one server; ``serving_report``:
  the JSON document, tables and ratios; ``serving_script``: the script's body.

Workloads live in ``asyncbatch.bench.workloads``.
"""
