#!/bin/bash
# $1 rounds of issue 24's sim command with speculation (spec) and without (plain), interleaved, each a fresh
# process from /tmp with PYTHONPATH=$TREE; reports under $OUT/runs/<mode>-<round>. One line per run: the
# overlap run's whole-run busy, then idle ms / steps / busy of each step kind (report.json "step_kinds"), and
# the idle time whose cause is `wakeup`.
# PROBE_ENV=NAME=VALUE (for a probe patch that reads NAME, e.g. output-thread-nice/probe.patch): each mode also
# runs with it set, right after the run without; those lines and reports carry "probe" after the mode.
TREE=${TREE:?the tree measured}; OUT=${OUT:-.}; PY=${PY:-python}
variants=(""); [ -n "${PROBE_ENV:-}" ] && variants=("" "$PROBE_ENV")
mkdir -p "$OUT/runs"
for i in $(seq 1 "$1"); do
  for m in spec plain; do
    for v in "${variants[@]}"; do
      tag=$m${v:+-probe}; out=$OUT/runs/$tag-$i; rm -rf "$out"
      (cd /tmp && env $v PYTHONPATH="$TREE" timeout 300 "$PY" -m asyncbatch profile --device sim --num-requests 256 \
        --max-num-seqs 256 --prompt-len 32 --output-len 400 --sim-step-ms 1 --sim-per-token-us 0 \
        --sim-per-context-ns 0 $([ $m = spec ] && echo --speculative-config '{"disable_by_batch_size":null}') \
        --out "$out" > "$out.log" 2>&1)
      "$PY" - "$out/report.json" "${tag/-/ }" "$i" <<'PYEOF'
import json, sys
g = json.load(open(sys.argv[1]))["runs"]["overlap"]["gap_report"]
kinds = " ".join(f"{k} {v['idle_ms']:.2f}/{v['steps']}/{100 * v['busy_fraction']:.2f}%" for k, v in g["step_kinds"].items())
print(f"{sys.argv[2]} {sys.argv[3]} busy {100 * g['device_busy_fraction']:.2f}% idle_ms {g['idle_ms']:.2f} {kinds} "
      f"wakeup_ms {g['causes_ms']['wakeup']:.2f}")
PYEOF
    done
  done
done
