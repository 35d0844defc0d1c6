#!/usr/bin/env bash
# Set up, then run the whole test suite (slow tests included; GPU tests skip without CUDA). The cluster extra
# (Ray Serve) is installed so tests/test_cluster_ray.py runs, and the structured extra (xgrammar) so the
# structured-output tests do; EXTRAS=dev,serve skips both.
#
# Without arguments: two pytest-xdist workers for everything but the tests marked `exclusive` (they measure
# how busy the device was, which a neighbour test on the same cores would change), then those alone.
# Much of the suite waits (servers, Ray, subprocesses, simulated steps), so two workers on two cores halve
# the wall time; conftest.py gives each worker's engines half the cores. Whole modules go to a worker
# (loadscope), so a module's shared fixtures are built once; loadgroup would be finer, but with pytest 9.2
# it silently stops grouping (pytest-dev/pytest-xdist#1386). With arguments: one pytest
# process, as `pytest -q ARGS` (e.g. `bash scripts/test.sh tests/test_sampler.py -k seed`).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-dev,serve,cluster,structured} bash scripts/setup_env.sh
PY="${VENV:-.venv}/bin/python"
# Compiled graphs (inductor's C++ for compile_decode, Triton's kernels) kept in one place for every worker,
# subprocess and later run on this machine, so each is compiled once.
CACHE="${ASYNCBATCH_CACHE:-$HOME/.cache/asyncbatch}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$CACHE/inductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$CACHE/triton}"
if [[ $# -gt 0 ]]; then
  exec "$PY" -m pytest -q "$@"
fi
status=0
"$PY" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder -m "not exclusive" || status=$?
"$PY" -m pytest -q -m exclusive || { rc=$?; [[ $status -ne 0 ]] || status=$rc; }
exit "$status"
