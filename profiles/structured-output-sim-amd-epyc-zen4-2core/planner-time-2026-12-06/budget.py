"""One run of the 1 ms structured-output benchmark's configuration (``scripts/bench_structured.py``: 256 running,
128 under its JSON schema, all at once) with the planner's stages (medians over the steady window) and each
thread's CPU time a step (over the whole run: admission and warm-up included, in 10 ms ticks). ``INPROC=1``: the
engine core in this process, so that its threads have names (Python 3.11 gives the OS none) and py-spy sees them.
``TOKENS``: output tokens a request (160, the benchmark's). ``N``: runs.

    python budget.py overlap            # or none / naive
    INPROC=1 TOKENS=800 N=4 py-spy record --nonblocking -r 200 -f raw --threads -o prof.txt -- python budget.py overlap
    python spy_summary.py prof.txt      # the planner thread's busy samples in the steady state, by function
"""
import os
import statistics
import sys
import threading
import time
from pathlib import Path

TREE = os.environ.get("TREE", str(Path(__file__).resolve().parents[3]))
sys.path[:0] = [TREE, str(Path(TREE) / "scripts")]

import psutil
from bench_structured import SCHEMA

from asyncbatch import LLM, SamplingParams, SimConfig, StructuredOutputsParams
from asyncbatch.profiling.gap_report import attribute_gaps
from asyncbatch.profiling.timeline import steady_decode_window

RUNNING, GRAMMAR_ROWS = 256, 128
TOKENS = int(os.environ.get("TOKENS", "160"))
INPROC = bool(os.environ.get("INPROC"))


def thread_cpu(processes: list) -> dict:
    return {(p.pid, t.id): t.user_time + t.system_time for p in processes for t in p.threads()}


def main(config: str) -> None:
    sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0,
                    output_len_distribution="fixed", output_len_max=10 * TOKENS)
    constraint = StructuredOutputsParams(json=SCHEMA)
    grammar_rows = 0 if config == "none" else GRAMMAR_ROWS
    params = [SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=i, ignore_eos=True,
                             structured_outputs=constraint if i < grammar_rows else None) for i in range(RUNNING)]
    with LLM(device="sim", max_num_seqs=RUNNING, max_num_batched_tokens=2048, sim=sim,
             grammar_mask_overlap=config != "naive", engine_process=not INPROC) as llm:
        llm.generate(["warm up"], SamplingParams(max_tokens=2, structured_outputs=constraint), use_tqdm=False)
        me = psutil.Process()
        watched = [me] + me.children(recursive=True)
        names = {t.native_id: t.name for t in threading.enumerate()}
        llm.reset_stats()
        before, t0 = thread_cpu(watched), time.perf_counter()
        llm.generate([f"request {i}" for i in range(RUNNING)], params, use_tqdm=False)
        wall, after = time.perf_counter() - t0, thread_cpu(watched)
        records = llm.timeline.window()
    window = steady_decode_window(records, min_decode=int(0.9 * RUNNING))
    steps = len(records)
    stages = {"schedule": [(r.schedule_end - r.plan_start) * 1e3 for r in window],
              "write": [(r.plan_end - r.fence_end) * 1e3 for r in window],
              "launch": [(r.launch_end - r.plan_end) * 1e3 for r in window],
              "result": [max(r.wait_end - r.device_end, 0.0) * 1e3 for r in window],
              "apply": [(r.apply_end - r.wait_end) * 1e3 for r in window],
              "apply_cpu": [r.apply_cpu_ms for r in window],
              "fill": [r.mask_fill_ms for r in window], "fill_cpu": [r.mask_fill_cpu_ms for r in window]}
    per_thread = {names.get(tid, f"{'caller' if pid == me.pid else 'core'}-{tid}"): (cpu - before.get((pid, tid), 0.0))
                  / steps * 1e3 for (pid, tid), cpu in after.items()}
    print(f"{config}: busy {attribute_gaps(window).busy_fraction:.3f}, {steps} steps in {wall * 1e3:.0f} ms | "
          + " ".join(f"{k} {statistics.median(v):.3f}" for k, v in stages.items())
          + " | CPU ms a step: " + " ".join(f"{k} {v:.2f}" for k, v in sorted(per_thread.items()) if v > 0.005))


if __name__ == "__main__":
    for _ in range(int(os.environ.get("N", "1"))):
        main(sys.argv[1] if len(sys.argv) > 1 else "overlap")
