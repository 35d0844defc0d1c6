#!/bin/bash
# ab.sh BASE_TREE AFTER_TREE ROUNDS BURSTS [PROMPT_LEN]: bursts.py in each tree, alternating, a fresh engine each;
# prints "base [...]" / "after [...]" lines (PIN=1 passes through).
here="$(cd "$(dirname "$0")" && pwd)"
for r in $(seq 1 "$3"); do
  for t in base after; do
    if [ $t = base ]; then tree=$1; else tree=$2; fi
    echo "$t $(cd /tmp && PYTHONPATH=$tree "${PYTHON:-python}" "$here/bursts.py" "$4" "${5:-32}" "$r" 2>/dev/null | tail -1)"
  done
done
