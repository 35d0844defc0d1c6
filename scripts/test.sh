#!/usr/bin/env bash
# Set up, then run the whole test suite (slow tests included; GPU tests skip without CUDA). The cluster extra
# (Ray Serve) is installed so tests/test_cluster_ray.py runs; EXTRAS=dev,serve skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-dev,serve,cluster} bash scripts/setup_env.sh
exec "${VENV:-.venv}/bin/python" -m pytest -q "$@"
