#!/usr/bin/env bash
# Set up, then run the whole test suite (slow tests included; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,serve bash scripts/setup_env.sh
exec "${VENV:-.venv}/bin/python" -m pytest -q "$@"
