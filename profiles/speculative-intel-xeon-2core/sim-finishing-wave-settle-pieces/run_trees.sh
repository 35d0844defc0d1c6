#!/bin/bash
# Kept as run (2026-12-03, 08:11-08:17 UTC): worktrees of e6cb020 (base), 5a59c24 (c1: settle in pieces), c9ac667 (c2: + sim is_done)
# and a later-dropped commit (c3: + generate decodes texts at the end), fresh processes from /tmp, interleaved.
# $1 rounds; trees: base=e6cb020, c1=+pieces, c2=+sim is_done, c3=+collected text (main); SPEC=1 for speculation
for i in $(seq 1 $1); do
  for t in base c1 c2 c3; do
    case $t in base) tree=/tmp/wt-base;; c1) tree=/tmp/wt-c1;; c2) tree=/tmp/wt-c2;; c3) tree=/work/main;; esac
    out=/tmp/adm2/q/${SPEC:+spec-}$t-$i
    rm -rf $out; mkdir -p /tmp/adm2/q
    (cd /tmp && PYTHONPATH=$tree timeout 300 /work/main/.venv/bin/python -m asyncbatch profile --device sim --num-requests 256 --max-num-seqs 256 --prompt-len 32 --output-len 400 --sim-step-ms 1 --sim-per-token-us 0 --sim-per-context-ns 0 ${SPEC:+--speculative-config '{"disable_by_batch_size": null}'} --out $out > $out.log 2>&1)
    echo "$t $i $(grep -E '^device busy' $out/report.md | awk '{print $3}') wall $(grep -E '^output tokens/s' $out/report.md | awk '{print $4}') $(grep -E '^idle ms per gap' $out/report.md | awk '{print "gap", $(NF-1)}')"
  done
done
