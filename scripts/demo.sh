#!/usr/bin/env bash
# The main job: set up, then a short generation and a short overlap/synchronous throughput table
# on the default model (SmolLM2-135M-Instruct). Extra arguments go to `asyncbatch demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${VENV:-.venv}/bin/python" -m asyncbatch demo "$@"
