"""One run of the 1 ms structured-output benchmark's configuration (``scripts/bench_structured.py``: 256 running,
128 under its JSON schema, all at once) with its host chain printed: the busy fraction, the medians of the links
(result: the step's device end to the planner holding its tokens; apply and its CPU time; the mask fill and its
CPU time) and the idle those runs summed. ``PIN=core``: every thread of the engine core's process on CPU 1 and the
caller's (the frontend's) on CPU 0; ``PIN=planner``: the planner thread alone on CPU 1, every other thread on CPU 0
(Linux, two CPUs or more). ``TREE``: the checkout to import (default: this one).

    python probe.py overlap                # or none / naive
    PIN=core python probe.py overlap
"""
import itertools
import os
import statistics
import sys
from pathlib import Path

TREE = os.environ.get("TREE", str(Path(__file__).resolve().parents[3]))
sys.path[:0] = [TREE, str(Path(TREE) / "scripts")]

import psutil
from bench_structured import SCHEMA

from asyncbatch import LLM, SamplingParams, SimConfig, StructuredOutputsParams
from asyncbatch.profiling.gap_report import attribute_gaps
from asyncbatch.profiling.timeline import steady_decode_window

RUNNING, GRAMMAR_ROWS, TOKENS = 256, 128, 160


def pin(placement: str) -> None:
    """Place this process's and its children's threads as ``placement`` says (see the module docstring)."""
    me = psutil.Process(os.getpid())
    for child in me.children(recursive=True):
        for thread in child.threads():
            name = Path(f"/proc/{child.pid}/task/{thread.id}/comm").read_text().strip()
            alone = placement == "core" or name.startswith("asyncbatch-plan")
            os.sched_setaffinity(thread.id, {1} if alone else {0})
    for thread in me.threads():
        os.sched_setaffinity(thread.id, {0})


def main(config: str) -> None:
    sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0,
                    output_len_distribution="fixed", output_len_max=10 * TOKENS)
    constraint = StructuredOutputsParams(json=SCHEMA)
    grammar_rows = 0 if config == "none" else GRAMMAR_ROWS
    params = [SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=i, ignore_eos=True,
                             structured_outputs=constraint if i < grammar_rows else None) for i in range(RUNNING)]
    with LLM(device="sim", max_num_seqs=RUNNING, max_num_batched_tokens=2048, sim=sim,
             grammar_mask_overlap=config != "naive") as llm:
        llm.generate(["warm up"], SamplingParams(max_tokens=2, structured_outputs=constraint), use_tqdm=False)
        if os.environ.get("PIN"):
            pin(os.environ["PIN"])
        llm.reset_stats()
        llm.generate([f"request {i}" for i in range(RUNNING)], params, use_tqdm=False)
        records = llm.timeline.window()
    window = steady_decode_window(records, min_decode=int(0.9 * RUNNING))
    links = {"result": [(a.wait_end - a.device_end) * 1e3 for a in window if a.wait_end > a.device_end],
             "apply": [(a.apply_end - a.wait_end) * 1e3 for a in window],
             "applycpu": [a.apply_cpu_ms for a in window],
             "fill": [r.mask_fill_ms for r in window], "fillcpu": [r.mask_fill_cpu_ms for r in window]}
    idle = sum(max(b.device_start - a.device_end, 0.0) * 1e3 + b.mask_wait_ms for a, b in itertools.pairwise(window))
    print(f"{config} placement {os.environ.get('PIN') or '-'} busy {attribute_gaps(window).busy_fraction:.3f} "
          + " ".join(f"{k} {statistics.median(v):.3f}" for k, v in links.items() if v)
          + f" | idle {idle:.1f} ms over {len(window)} steps")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "overlap")
