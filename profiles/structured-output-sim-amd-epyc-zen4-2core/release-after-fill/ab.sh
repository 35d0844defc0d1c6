#!/bin/bash
# Side by side: BASE (a worktree of the commit before) against this tree, interleaved, the issue's benchmark at
# 1 ms (all at once) and its staggered variant (53 waves). Each run's report in <out>/<tree>-<round>-stagger-<k>/.
#   bash ab.sh /tmp/wt-base <out> [rounds]
base=$1; out=$2; rounds=${3:-4}
here=$(cd "$(dirname "$0")/../../.." && pwd)
for i in $(seq 1 "$rounds"); do for k in 0 53; do for tree in base new; do
  dir=$([ $tree = base ] && echo "$base" || echo "$here")
  PYTHONPATH=$dir python "$here/scripts/bench_structured.py" --step-ms 1 --stagger-steps $k \
    --out "$out/$tree-$i-stagger-$k" > /dev/null 2>&1
  echo "$tree round $i stagger $k: $(grep -E '^\| 1 ms \| overlap' "$out/$tree-$i-stagger-$k/report.md" | awk -F'|' '{print "overlap/none" $6 " mask wait ms/step" $9 " idle ms/step" $12}')"
done; done; done
