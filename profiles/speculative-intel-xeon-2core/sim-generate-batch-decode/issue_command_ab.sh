#!/bin/bash
# $1 rounds of issue 24's sim command, with speculation (spec) and without (plain), for two trees interleaved:
# BASE (a worktree of the commit before) and TREE (this one), each run a fresh process from /tmp with
# PYTHONPATH=<tree>. Reports under $OUT/runs/<tree>-<mode>-<round>; one line per run (device busy, idle ms).
BASE=${BASE:?a worktree of the commit before}; TREE=${TREE:?the tree measured}; OUT=${OUT:-.}
PY=${PY:-python}
for i in $(seq 1 "$1"); do
  for m in spec plain; do
    for t in "$BASE" "$TREE"; do
      name=$([ "$t" = "$BASE" ] && echo wt || echo main)
      out=$OUT/runs/$name-$m-$i; rm -rf "$out"; mkdir -p "$OUT/runs"
      (cd /tmp && PYTHONPATH=$t timeout 300 "$PY" -m asyncbatch profile --device sim --num-requests 256 \
        --max-num-seqs 256 --prompt-len 32 --output-len 400 --sim-step-ms 1 --sim-per-token-us 0 \
        --sim-per-context-ns 0 $([ $m = spec ] && echo --speculative-config '{"disable_by_batch_size":null}') \
        --out "$out" > "$out.log" 2>&1)
      echo "$name $m $i $(grep -E '^device busy' "$out/report.md" | awk '{print $3}')" \
           "idle_ms $(grep -E '^idle ms total' "$out/report.md" | awk '{print $4}')"
    done
  done
done
