#!/usr/bin/env bash
TREE=$1; PORT=$2; TAG=$3; shift 3
cd /work/main
PYTHONPATH=$TREE .venv/bin/python -m asyncbatch serve --device sim --port $PORT --host 127.0.0.1 --max-num-seqs 256 "$@" > /tmp/s30_srv_$TAG.log 2>&1 &
SRV=$!
for i in $(seq 60); do curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 0.5; done
snap() { for t in /proc/$SRV/task/*; do echo "$(cat $t/comm) $(awk '{print $14, $15}' $t/stat)"; done; CORE=$(pgrep -P $SRV | head -1); for c in $(pgrep -P $SRV); do for t in /proc/$c/task/*; do echo "core:$(cat $t/comm) $(awk '{print $14, $15}' $t/stat)"; done; done; }
snap > /tmp/s30_bench/$TAG.t0
timeout 300 .venv/bin/python scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --workload uniform --prompt-range 16,128 --output-range 512,1024 --num-prompts 512 --request-rates inf --prompt-format token-ids --warmup-requests 0 --out /tmp/s30_bench --tag $TAG > /tmp/s30_bench/$TAG.client 2>&1 &
B=$!
wait $B
snap > /tmp/s30_bench/$TAG.t1
kill -TERM $SRV; wait $SRV
paste /tmp/s30_bench/$TAG.t0 /tmp/s30_bench/$TAG.t1 | awk '{d=($5+$6)-($2+$3); if (d>5) print $1, "user+sys ticks", ($5-$2), ($6-$3)}'
