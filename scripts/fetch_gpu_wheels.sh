#!/usr/bin/env bash
# Wheels for the lent GPU machine, which has Python 3.12 and no network: xgrammar (the structured extra) and what it
# needs that the machine's image lacks (/work/.library/device/KINDS.md lists what it has: torch, transformers,
# triton, numpy are there), at the versions this checkout's virtualenv holds, so that the set is one pip resolved
# together (pydantic pins its pydantic-core). Into .cache/wheels/structured (~7 MB), which scripts/gpu_check.sh
# installs under its own temporary folder for its structured-outputs stage; carry the folder with the run.
#
#   EXTRAS=dev,structured bash scripts/setup_env.sh   # once, if the virtualenv lacks xgrammar
#   bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
DEST=.cache/wheels/structured
PACKAGES=(xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions)
# pip matches a wheel's manylinux tag exactly: every tag the machine's glibc accepts that these wheels use.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
rm -rf "$DEST"
mkdir -p "$DEST"
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  if [[ -z "$version" ]]; then
    echo "$name is not installed in $PY's environment: EXTRAS=dev,structured bash scripts/setup_env.sh" >&2
    exit 1
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "$name==$version"
done
ls -l "$DEST"
