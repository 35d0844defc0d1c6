"""What the scripts in ``scripts/`` share, on top of the package's ``asyncbatch.bench``.

- ``common``: the one helper module every script uses (log line, free port, the before/after runner);
- the offline multi-system harness: ``system_base`` (interface, settings), ``system_asyncbatch``,
  ``systems`` (the registry), ``runner`` (repeats, rotation, correctness), ``records`` and
  ``run_metrics`` (what a run measured), ``memory``, ``report`` and ``results_schema`` (the document),
  ``script`` (the body of ``bench_throughput.py`` and ``bench_latency.py``);
- the peer adapters: ``system_hf_static``, ``system_hf_continuous`` (+ ``hf_common``): transformers;
  ``system_llamacpp``: llama.cpp; ``serving_servers`` and ``serving_peers``: asyncbatch serve and
  transformers serve as subprocesses for ``bench_serving.py``;
- ``plots``; ``decode_step`` and ``quality`` (+ ``data/``): the CPU step and precision studies.

Not part of the installed package; the scripts find it as their own folder's package, the tests through
pytest's ``pythonpath``.
"""
