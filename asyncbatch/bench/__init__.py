"""What users run to benchmark asyncbatch: ``python -m asyncbatch.bench --base-url URL --out DIR``.

A serving client against any OpenAI-compatible server (asyncbatch serve, vLLM, transformers serve),
the workloads, the metrics and the reports, as vLLM keeps them in ``vllm/benchmarks``. The peer
adapters (transformers, llama.cpp), the offline multi-system harness, plots, studies and before/after
tools live outside the package, in the repository's ``scripts/``, and build on these modules.

One concept per module:

- ``workloads``: the request sets (uniform, random, ShareGPT-like, nano-vllm's, shared prefix,
  multi-turn); ``arrivals``: Poisson and gamma (bursty) arrival times;
- ``metrics``: what TTFT, TPOT, ITL and throughput mean, latency distributions, spreads over repeats;
  ``host_load``: how much of the CPUs other processes (and a server's processes) took;
- ``serving_client``: the async streaming client and its per-request records; ``serving_metrics``:
  throughput, goodput under an SLO, latency percentiles; ``serving_prometheus``: the server's /metrics
  (device busy, running requests); ``serving_runner``: warm-up and load points against one server;
- ``serving_report``: the JSON document, tables and ratios; ``report``: the machine a figure was
  measured on and how a results JSON is written; ``schema``: the document's schema and validator;
- ``serving_script``: the benchmark's body and options; ``__main__``: the command.
"""
