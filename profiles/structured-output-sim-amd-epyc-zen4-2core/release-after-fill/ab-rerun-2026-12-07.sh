#!/bin/bash
# bash ab_rel.sh <out> <rounds>: 78d9968 (before) against 8c79adb (release after fill), each run in its own tree's folder
out=$1; rounds=$2; mkdir -p $out
for i in $(seq 1 "$rounds"); do
  order="before after"; [ $((i % 2)) = 0 ] && order="after before"
  for tree in $order; do
    dir=$([ $tree = before ] && echo /tmp/wt-old || echo /tmp/wt-rel)
    cd $dir; PYTHONPATH=$dir /work/main/.venv/bin/python scripts/bench_structured.py --step-ms 1 --out "$out/$tree-$i" > /dev/null 2>&1
    echo "$tree round $i load $(cut -d' ' -f1 /proc/loadavg): $(grep -E '^\| 1 ms \| overlap' "$out/$tree-$i/report.md" | awk -F'|' '{print "overlap/none" $6}') last step in the idlest: $(grep -A14 'idlest steps\|10 idlest' "$out/$tree-$i/report.md" | grep -cE '^\| 16[0-9] ')"
  done
done
