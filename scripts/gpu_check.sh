#!/usr/bin/env bash
# Prepared check for a lent GPU machine (no network, nothing installed there; it has torch, triton,
# transformers, pytest). Runs from the repository root of a copy of the tree:
#
#   1. environment   (nvidia-smi, versions)                                   -> $OUT/env.txt
#   2. CUDA tests    (Triton kernels, graphs vs eager, overlap vs sync,
#                     no host sync on the launch path, grammar
#                     masks enqueued by masks_ready, the fused
#                     elementwise kernels)                         <= 150 s    -> $OUT/tests.log
#   3. attention     (Triton decode/prefill vs torch: both decode
#                     kernels with their tile, split and warp
#                     variants, 256 rows x 512 and 8 rows x 4096
#                     cached, SmolLM2 shape, bf16; host us per
#                     eager launch of each)                        <=  60 s    -> $OUT/attention.log, attention_bench.json
#   4. step profile  (one decode step of SmolLM2-135M bf16, 256 rows
#                     x 128 / 512 cached, each decode kernel and
#                     the split one with fused elementwise kernels:
#                     device time by kernel kind and name, graph
#                     replay beside it)                            <=  60 s    -> $OUT/step_profile.md
#   5. benchmark     (SmolLM2-135M bf16, 256 requests: overlap/sync x
#                     graphs on/off; overlap+graphs with the fused
#                     elementwise kernels, with the grouped decode
#                     kernel, and with logprobs / penalty
#                     rows among the requests)                     <= 210 s    -> $OUT/bench.log, report.json
#   6. structured    (issue 23's benchmark on the simulated device:
#                     no GPU in it, the host's cores are what it
#                     measures; 1 and 5 ms steps, 3 rounds; needs
#                     xgrammar: carried wheels, see below)          <=  75 s    -> appended to $OUT/bench.log
#   7. summary       (test counts, the tables; printed last)                   -> $OUT/summary.txt
#
# Eight files in $OUT, as many as the device tool brings back (the Markdown tables are in summary.txt).
# Finishes in 9.75 minutes at most: every stage runs under `timeout` (30 + 150 + 60 + 60 + 210 + 75 s at most).
# The model is looked for under $ASYNCBATCH_CACHE, ./.cache/asyncbatch/SmolLM2*, ~/.cache/asyncbatch and the Hugging Face cache;
# without one the benchmark uses random weights of SmolLM2-135M's shape and its report says so first.
# Outside the device tool, $OUT defaults to results/gpu_check. PYTHON picks the interpreter (python3).
# With the device tool (the real weights, 513 MiB, cannot travel; config and tokenizer, 3.4 MB, can):
#   mkdir -p .cache/asyncbatch/SmolLM2-135M-Instruct
#   cp ~/.cache/asyncbatch/SmolLM2-135M-Instruct*/{config.json,tokenizer.json,tokenizer_config.json} \
#      .cache/asyncbatch/SmolLM2-135M-Instruct/
#   bash scripts/fetch_gpu_wheels.sh      # xgrammar and what it needs, for the machine's Python 3.12 (7 MB)
#   run(command="bash scripts/gpu_check.sh",
#       carry=[".cache/asyncbatch/SmolLM2-135M-Instruct", ".cache/wheels/structured"], timeout_s=595)
# then commit $OUT's files under profiles/<gpu>-<date>/ with the hardware named, and give the machine back.
# GPU_CHECK_SMOKE=<tiny model dir> runs every stage on the CPU at toy sizes: tests/test_gpu_scripts.py uses it
# so that this script's own plumbing is tested before a GPU session spends its minutes on it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/results/gpu_check}
mkdir -p "$OUT"
rm -f "$OUT"/report.json "$OUT"/attention_bench.json
WORK=$(mktemp -d)  # the scripts' own output folder; only what is listed above is copied to $OUT
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0  # compiled kernels, also where tests/conftest.py would choose the interpreter
TESTS=(tests/test_triton_attention.py tests/test_cuda_path.py tests/test_cuda_graphs.py
       tests/test_decode_graph.py tests/test_grammar_plumbing.py tests/test_fused_elementwise.py)
ATTENTION_ARGS=(--decode-shapes 256x512,8x4096)
STEP_ARGS=()
BENCH_ARGS=()
STRUCTURED_ARGS=(--step-ms 1 5 --rounds 3 --model .cache/asyncbatch/SmolLM2-135M-Instruct)
WHEELS=.cache/wheels/structured  # scripts/fetch_gpu_wheels.sh; installed for stage 6 alone, under $WORK
# Stage limits, in seconds: they split a GPU session's minutes. The CPU smoke run gets four times as long,
# since a loaded 2-core CI machine is slower at its toy sizes than an H200 at the real ones.
SLOW=1
if [[ -n "${GPU_CHECK_SMOKE:-}" ]]; then
  SLOW=4
  TESTS=(tests/test_cuda_path.py)  # skips without CUDA: exercises the stage, not the tests
  ATTENTION_ARGS=(--device cpu --dtype float32 --heads 4 --kv-heads 2 --head-dim 16 --block-size 4
                  --decode-shapes 2x12 --prefill-rows 1 --prefill-len 20 --calls 1 --repeats 1)
  # A GPU step has no lean CPU step (model/lean_step.py): the smoke runs the torch ops a GPU step would.
  export ASYNCBATCH_CPU_LEAN_STEP=0
  STEP_ARGS=(--device cpu --dtype float32 --model "$GPU_CHECK_SMOKE" --rows 4 --contexts 8 --steps 2
             --decode-kernels grouped,grouped+fused)
  BENCH_ARGS=(--device cpu --dtype float32 --model "$GPU_CHECK_SMOKE" --num-requests 4 --max-num-seqs 4
              --max-model-len 64 --prompt-range 4,8 --output-range 4,8 --repeats 1)
  STRUCTURED_ARGS=(--quick --model "$GPU_CHECK_SMOKE")
fi

{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)"
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
  timeout $((30 * SLOW)) "$PY" - <<'EOF' 2>&1
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    free, total = torch.cuda.mem_get_info()
    print(f"memory free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
for name in ("triton", "transformers", "pytest", "hypothesis"):
    try:
        print(name, __import__(name).__version__)
    except Exception as exc:
        print(name, "MISSING", exc)
EOF
} > "$OUT/env.txt"
cat "$OUT/env.txt"

echo "== CUDA tests"
timeout $((150 * SLOW)) "$PY" -m pytest -q -p no:cacheprovider -rs "${TESTS[@]}" > "$OUT/tests.log" 2>&1
tests_rc=$?
tail -n 25 "$OUT/tests.log"

echo "== attention kernels"
timeout $((60 * SLOW)) "$PY" scripts/attention_bench.py --out "$WORK" "${ATTENTION_ARGS[@]}" > "$OUT/attention.log" 2>&1
attention_rc=$?
cp "$WORK/attention_bench.json" "$OUT/" 2>/dev/null
tail -n 30 "$OUT/attention.log"

echo "== step profile"
timeout $((60 * SLOW)) "$PY" scripts/gpu_step_profile.py --out "$WORK" "${STEP_ARGS[@]}" > "$WORK/step_profile.log" 2>&1
step_rc=$?
cp "$WORK/step_profile.md" "$OUT/" 2>/dev/null || tail -n 30 "$WORK/step_profile.log" > "$OUT/step_profile.md"
head -n 20 "$OUT/step_profile.md"

echo "== benchmark"
timeout $((210 * SLOW)) "$PY" scripts/gpu_bench.py --out "$WORK" "${BENCH_ARGS[@]}" "$@" > "$OUT/bench.log" 2>&1
bench_rc=$?
cp "$WORK/report.json" "$OUT/" 2>/dev/null
tail -n 5 "$OUT/bench.log"

echo "== structured outputs (sim)"
# The engine's host work with grammar rows, on this machine's cores: the 1 ms figure of issue 23 could not be met
# on 2-vCPU VMs whose speed swings between runs (profiles/structured-output-sim-amd-epyc-zen4-2core).
structured_env=()
if ! "$PY" -c "import xgrammar" 2>/dev/null && compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl \
    > "$WORK/wheels.log" 2>&1 || cat "$WORK/wheels.log"
  structured_env=(env "PYTHONPATH=$WORK/site:$PYTHONPATH")
fi
if "${structured_env[@]}" "$PY" -c "import xgrammar" 2>/dev/null; then
  { echo; echo "== structured outputs benchmark (scripts/bench_structured.py ${STRUCTURED_ARGS[*]})"; } >> "$OUT/bench.log"
  timeout $((75 * SLOW)) "${structured_env[@]}" "$PY" scripts/bench_structured.py --out "$WORK/structured" \
    "${STRUCTURED_ARGS[@]}" >> "$OUT/bench.log" 2>&1
  structured_rc=$?
else
  echo "skipped: xgrammar cannot be imported and $WHEELS holds no wheels (scripts/fetch_gpu_wheels.sh)" \
    | tee -a "$OUT/bench.log"
  structured_rc=skipped
fi
tail -n 3 "$OUT/bench.log"

{
  echo "== summary (tests rc=$tests_rc, attention rc=$attention_rc, step profile rc=$step_rc, benchmark rc=$bench_rc," \
       "structured rc=$structured_rc; 124 = timed out)"
  grep -E "^(device|python)" "$OUT/env.txt"
  echo "tests: $(tail -n 1 "$OUT/tests.log")"
  if [[ -f "$WORK/attention_bench.md" ]]; then cat "$WORK/attention_bench.md"; else echo "no attention table"; fi
  cat "$OUT/step_profile.md"
  if [[ -f "$WORK/report.md" ]]; then cat "$WORK/report.md"; else echo "no benchmark report (see bench.log)"; fi
  if [[ -f "$WORK/structured/report.md" ]]; then cat "$WORK/structured/report.md"
  else echo "no structured outputs report (see bench.log)"; fi
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
[[ $tests_rc -eq 0 && $attention_rc -eq 0 && $step_rc -eq 0 && $bench_rc -eq 0 && $structured_rc != [1-9]* ]]
