#!/bin/bash
# bash ab.sh <out> <rounds> [stagger] : base (/tmp/wt-base) against /work/main, alternating which goes first
out=$1; rounds=$2; k=${3:-0}
mkdir -p $out
for i in $(seq 1 "$rounds"); do
  order="base new"; [ $((i % 2)) = 0 ] && order="new base"
  for tree in $order; do
    dir=$([ $tree = base ] && echo /tmp/wt-base || echo /work/main)
    cd $dir; PYTHONPATH=$dir /work/main/.venv/bin/python "$dir/scripts/bench_structured.py" --step-ms 1 --stagger-steps $k \
      --out "$out/$tree-$i" > /dev/null 2>&1
    echo "$tree round $i stagger $k load $(cut -d' ' -f1 /proc/loadavg): $(grep -E '^\| 1 ms \| overlap' "$out/$tree-$i/report.md" | awk -F'|' '{print "overlap/none" $6 " fill us/row" $7 " idle ms/step" $12 " tok/s" $13}')"
  done
done
