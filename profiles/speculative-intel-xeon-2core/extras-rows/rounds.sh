#!/usr/bin/env bash
# Trees side by side, fresh processes, interleaved: each NAME=PATH argument after the round count is a tree
# (a worktree of a commit, or the checkout), run in the order given, each extra (EXTRAS, default: logprobs json
# none; bias and json-schema also exist) in turn; ON=all gives every request the extra; SPEC=draft-self drafts
# with the default model itself instead of n-gram lookup.
#   OUT=/tmp/mixed bash rounds.sh 2 before=/tmp/wt-ref after=/work/main
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PY:-$HERE/../../../.venv/bin/python}"
rounds=$1; shift
mkdir -p "$OUT"
cd /tmp  # PYTHONPATH, not the working directory, decides whose code runs (the engine-core process too)
for round in $(seq 1 "$rounds"); do
  for extra in ${EXTRAS:-logprobs json none}; do
    for named in "$@"; do
      name=${named%%=*}; tree=${named#*=}
      echo "round $round $name $(date -u +%T)"
      PYTHONPATH="$tree" "$PY" "$HERE/mixed_batch.py" "$OUT/$name-$extra-$round.json" --extra "$extra" \
        --on "${ON:-first}" --spec "${SPEC:-ngram}" 2>&1 | tail -1
    done
  done
done
