#!/bin/bash
# bench_structured.py at 1 ms, a worktree of the commit before (BASE) and this tree (NEW) in turns, ROUNDS each,
# fresh processes from /tmp; one JSON line per configuration and run in OUT/ab_{base,new}_N.jsonl.
#   BASE=/tmp/wt-base NEW=/work/main ROUNDS=8 OUT=/tmp/out bash ab_interleaved.sh
set -euo pipefail
PY=${PY:-$NEW/.venv/bin/python}
mkdir -p "$OUT"
cd /tmp
for i in $(seq 1 "$ROUNDS"); do
  for side in base new; do
    tree=$NEW; [[ $side == base ]] && tree=$BASE
    PYTHONPATH=$tree "$PY" "$tree/scripts/bench_structured.py" --step-ms 1 --out "$OUT/report_${side}_$i" \
      | grep '^{' > "$OUT/ab_${side}_$i.jsonl"
  done
done
