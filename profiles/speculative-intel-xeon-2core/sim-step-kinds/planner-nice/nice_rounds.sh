#!/bin/bash
# $1 rounds; each round: spec and plain, with AB_PLANNER_NICE unset and =10, interleaved
for i in $(seq 1 $1); do
  for m in spec plain; do
    for n in 0 -10; do
      out=/tmp/s8/pnice/$m-$n-$i; rm -rf $out; mkdir -p /tmp/s8/pnice
      extra=""; [ $n != 0 ] && extra="AB_PLANNER_NICE=$n"
      (cd /tmp && env $extra PYTHONPATH=/work/main timeout 300 /work/main/.venv/bin/python -m asyncbatch profile --device sim --num-requests 256 \
        --max-num-seqs 256 --prompt-len 32 --output-len 400 --sim-step-ms 1 --sim-per-token-us 0 \
        --sim-per-context-ns 0 $([ $m = spec ] && echo --speculative-config '{"disable_by_batch_size":null}') \
        --out $out > $out.log 2>&1)
      /work/main/.venv/bin/python - $out/report.json $m $n $i <<'PYEOF'
import json, sys
g = json.load(open(sys.argv[1]))["runs"]["overlap"]["gap_report"]
k = g["step_kinds"]
print(sys.argv[2], "nice", sys.argv[3], sys.argv[4], f"busy {100*g['device_busy_fraction']:.2f} steady_idle {k['steady']['idle_ms']:.2f} fin_idle {k['finishing']['idle_ms']:.2f} adm_idle {k['admitting']['idle_ms']:.2f} wakeup_ms {g['causes_ms']['wakeup']:.2f}")
PYEOF
    done
  done
done
