"""Which of the planner's functions let go of the GIL while the engine runs (``asyncbatch.profiling.gil_release``).

    python scripts/gil_release_scan.py --rows 256 --output-len 40

Runs a ``sim`` engine in this process (``engine_process=False``, so the planner thread is watched here), a burst
of ``--rows`` requests that all run together, and counts for each watched planner function how many of its calls
let the GIL go. A release on the planner's path gives the GIL to any thread that waits for it, and the planner
then waits to get it back; numpy releases it inside a scatter that casts, and in any loop past 500 elements.
Calls that block (a queue, the device's event) are not watched: they release by design.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

from asyncbatch import LLM, SamplingParams
from asyncbatch.config import SimConfig
from asyncbatch.engine import (
    admission,
    block_manager,
    row_state,
    scheduler,
    step_apply,
    step_extras,
    step_metadata,
)
from asyncbatch.profiling.gil_release import GilWatch

WATCHED = [
    (scheduler.Scheduler, ("schedule", "_schedule_decode", "_schedule_prefills", "apply", "release_drained",
                           "settle_released")),
    (admission.Admitter, ("admit",)),
    (row_state.RowState, ("admit_many", "append_outputs", "append_runs")),
    (block_manager.BlockManager, ("append_block",)),
    (step_apply.StepApplier, ("_apply",)),
    (step_metadata.StepMetadataWriter, ("write", "_write_decode", "_write_sampling_constants", "_decode_flags")),
    (step_extras.StepExtrasWriter, ("build",)),
]
PLANNER_THREAD = "asyncbatch-planner"


@contextlib.contextmanager
def watch_calls(watch: GilWatch) -> Iterator[tuple[collections.Counter, collections.Counter]]:
    """Wrap every ``WATCHED`` method while open: (calls, calls that let the GIL go), by name, on the planner
    thread. The originals are put back on exit."""
    calls: collections.Counter = collections.Counter()
    released: collections.Counter = collections.Counter()

    def counted(label: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def watched(*args, **kwargs):
            if threading.current_thread().name != PLANNER_THREAD:
                return function(*args, **kwargs)
            before = watch.count
            result = function(*args, **kwargs)
            calls[label] += 1
            released[label] += watch.count != before
            return result

        return watched

    # write_prefill is a module function, imported by name into step_metadata.
    targets = [(owner, name, f"{owner.__name__}.{name}") for owner, names in WATCHED for name in names]
    targets.append((step_metadata, "write_prefill", "write_prefill"))
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]
    for owner, name, label in targets:
        setattr(owner, name, counted(label, getattr(owner, name)))
    try:
        yield calls, released
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="requests, all running at once")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=40)
    args = parser.parse_args()
    # No planner warm-up: it rehearses admissions on the planner thread, and its calls would be counted.
    engine = {"device": "sim", "engine_process": False, "max_num_seqs": args.rows, "switch_interval_s": None,
              "planner_warmup": False, "max_num_batched_tokens": max(8192, args.rows * args.prompt_len),
              "skip_tokenizer_init": True, "sim": SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)}
    prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 1000 for j in range(args.prompt_len)]}
               for i in range(args.rows)]
    with GilWatch() as watch, watch_calls(watch) as (calls, released), LLM("smollm2-135m", **engine) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
        steps = llm.stats()["steps"]
    print(f"{args.rows} requests x {args.output_len} outputs, {steps} steps (sim, in-process)")
    print(f"{'function':46s} {'calls':>6s} {'let go of the GIL':>18s}")
    for label in sorted(calls):
        print(f"{label:46s} {calls[label]:6d} {released[label]:18d}")


if __name__ == "__main__":
    main()
