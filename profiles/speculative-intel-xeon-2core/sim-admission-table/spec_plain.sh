#!/bin/bash
# $1 rounds: the issue-24 sim command with and without speculation, this tree, interleaved
for i in $(seq 1 $1); do
  for m in spec plain; do
    out=/tmp/adm3/sp/$m-$i; rm -rf $out; mkdir -p /tmp/adm3/sp
    (cd /tmp && PYTHONPATH=${TREE:-/work/main} timeout 300 /work/main/.venv/bin/python -m asyncbatch profile --device sim --num-requests 256 --max-num-seqs 256 --prompt-len 32 --output-len 400 --sim-step-ms 1 --sim-per-token-us 0 --sim-per-context-ns 0 $([ $m = spec ] && echo --speculative-config '{"disable_by_batch_size":null}') --out $out > $out.log 2>&1)
    echo "$m $i $(grep -E '^device busy' $out/report.md | awk '{print $3}') idle_ms $(grep -E '^idle ms total' $out/report.md | awk '{print $4}') steps $(grep -E '^steps' $out/report.md | awk '{print $2}')"
  done
done
