#!/usr/bin/env bash
# Two trees side by side, fresh processes, interleaved: REF (a worktree of the commit before) and TREE.
#   REF=/tmp/wt-ref TREE=/work/main OUT=/tmp/mixed bash rounds.sh 2
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PY:-$TREE/.venv/bin/python}"
mkdir -p "$OUT"
cd /tmp  # PYTHONPATH, not the working directory, decides whose code runs (the engine-core process too)
for round in $(seq 1 "${1:-2}"); do
  for extra in logprobs json none; do
    for tree in ref new; do
      T=$([ "$tree" = ref ] && echo "$REF" || echo "$TREE")
      echo "round $round $tree $(date -u +%T)"
      PYTHONPATH="$T" "$PY" "$HERE/mixed_batch.py" "$OUT/$tree-$extra-$round.json" --extra "$extra" 2>&1 | tail -1
    done
  done
done
