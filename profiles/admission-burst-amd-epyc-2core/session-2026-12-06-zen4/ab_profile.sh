#!/bin/bash
# ab_profile.sh ROUNDS: issue 25's 256-burst command (--repeats 5), BASE and AFTER trees alternating, the order flipped each
# round; prints the device busy and admission CPU lines of each run (overlap first, then sync).
for r in $(seq 1 $1); do
  if [ $((r % 2)) = 1 ]; then order="base after"; else order="after base"; fi
  for t in $order; do
    if [ $t = base ]; then tree=${BASE:?a checkout of the commit before}; else tree=${AFTER:-$(cd "$(dirname "$0")/../../.." && pwd)}; fi
    line=$(cd /tmp && PYTHONPATH=$tree ${PYTHON:-python} -m asyncbatch profile --device sim --num-requests 256 --max-num-seqs 256 --prompt-len 32 --output-len 400 --sim-step-ms 1 --sim-per-token-us 0 --sim-per-context-ns 0 --repeats 5 2>/dev/null | grep -E "admission CPU us per admitted request|^  device busy" | tr -s ' ' | tr '\n' ' ')
    echo "$t $line"
  done
done
