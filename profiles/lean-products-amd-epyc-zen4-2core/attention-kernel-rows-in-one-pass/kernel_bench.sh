#!/bin/bash
# The decode attention kernel alone, before (lean_cpu.c at BASE, a git revision) and after (this tree's), in one
# binary, alternating calls: SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16), every row
# CONTEXT tokens over blocks scattered through the cache, the best of REPS calls each, and the largest difference of
# their outputs (float32 outputs). Built with the library's own flags (lean_kernels.FLAGS).
#   bash kernel_bench.sh [BASE]        (BASE: 12fbe86, the commit before the change)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../../.." && pwd); base=${1:-12fbe86}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
flags="-O3 -march=native -ffp-contract=off -fno-trapping-math -fopenmp"
git -C "$root" show "$base:asyncbatch/model/lean_cpu.c" \
  | sed 's/ab_decode_attention/ref_decode_attention/; s/^void ab_/static void unused_ab_/' > "$work/ref.c"
gcc $flags -c "$work/ref.c" -o "$work/ref.o"
gcc $flags -c "$root/asyncbatch/model/lean_cpu.c" -o "$work/new.o"
gcc $flags "$here/kernel_bench.c" "$work/ref.o" "$work/new.o" -o "$work/bench" -lm
for threads in 1 2; do
  echo "threads $threads"
  for ctx in 128 512 2048; do for dtype in 0 1; do "$work/bench" 32 $ctx $dtype 15 $threads; done; done
  for dtype in 0 1; do "$work/bench" 1 2048 $dtype 30 $threads; done
done
