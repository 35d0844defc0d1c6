#!/usr/bin/env bash
# Every thread's CPU ticks (user, system) of an `asyncbatch serve --device sim` server and its engine-core process
# over one bench_serving.py run (512 requests at once, 512-1,024 tokens each); prints the threads that used more
# than 5 ticks. Usage, from anywhere (the repository's .venv runs it):
#   bash threads.sh TREE PORT TAG [serve args...]     # TREE: the checkout to serve (PYTHONPATH); OUT=dir for logs
set -euo pipefail
TREE=$1; PORT=$2; TAG=$3; shift 3
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PYTHONPATH=$TREE .venv/bin/python -m asyncbatch serve --device sim --port "$PORT" --host 127.0.0.1 --max-num-seqs 256 \
  "$@" > "$OUT/server_$TAG.log" 2>&1 &
SRV=$!
for _ in $(seq 60); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
descendants() { for c in $(pgrep -P "$1" || true); do echo "$c"; descendants "$c"; done; }
snap() {  # the server's threads, then every thread of its descendants (the engine core is a fork server's child)
  for t in /proc/$SRV/task/*; do echo "$(cat "$t/comm") $(awk '{print $14, $15}' "$t/stat")"; done
  for c in $(descendants $SRV); do
    for t in /proc/$c/task/*; do echo "core:$c:$(cat "$t/comm") $(awk '{print $14, $15}' "$t/stat")"; done
  done
}
snap > "$OUT/$TAG.t0"
timeout 300 .venv/bin/python scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --workload uniform \
  --prompt-range 16,128 --output-range 512,1024 --num-prompts 512 --request-rates inf --prompt-format token-ids \
  --warmup-requests 0 --out "$OUT" --tag "$TAG" > "$OUT/$TAG.client" 2>&1
snap > "$OUT/$TAG.t1"
kill -TERM $SRV; wait $SRV || true
paste "$OUT/$TAG.t0" "$OUT/$TAG.t1" | awk '{d=($5+$6)-($2+$3); if (d>5) print $1, "user+sys ticks", ($5-$2), ($6-$3)}'
echo "logs: $OUT"
