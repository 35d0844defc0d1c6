"""Per-step host costs of a verify step at 256 rows (depth 4) against a plain step, one thread, no engine threads.

    PYTHONPATH=$PWD python profiles/speculative-amd-epyc-2core/host_costs.py      # any commit since 23b3c76

Prints, per kind of step, milliseconds per step (the minimum over ``--repeats`` runs of 100 steady steps, the
least disturbed by other work on a shared machine) of: the scheduler's plan, the metadata writer, applying
the step's tokens (``Scheduler.apply`` / ``apply_verified``, the reconciliation included), the simulated
device's own host work (``SimExecutor._run`` with 0 ms steps: staging copies and pseudo-token hashing, work a
real device does not put on the host) and the frontend's output processing of the step (``OutputProcessor``
replaying the step outputs of an in-process engine run of the same workload). Draft acceptance as on ``sim``
(0.7 a draft; 2.76 tokens a row per step).
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np

from asyncbatch.bench.workloads import uniform_requests
from asyncbatch.config import SimConfig
from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.executors.base import StepHandle
from asyncbatch.executors.sim_executor import SimExecutor
from asyncbatch.frontend.detokenizer import IncrementalDetokenizer
from asyncbatch.frontend.output_processor import OutputProcessor
from asyncbatch.frontend.request_handle import RequestHandle
from asyncbatch.frontend.stop_strings import StopStringMatcher
from asyncbatch.llm import LLM
from asyncbatch.outputs import RequestMetrics
from asyncbatch.profiling.timeline import Timeline
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.speculative.config import SpeculativeConfig

ROWS, STEPS, WARM = 256, 120, 20
SIM = SimConfig(step_fixed_ms=0.0, per_token_us=0.0, per_context_token_ns=0.0)


def planner_and_device(spec: bool) -> dict[str, float]:
    """ms per step of schedule, write, apply and the sim's host work, steps WARM..STEPS of 256 requests."""
    blocks = BlockManager(ROWS * 30, 16, ROWS, 32, prefix_caching=True)
    config = SpeculativeConfig(disable_by_batch_size=None) if spec else None
    sched = Scheduler(blocks, 8192, eos_token_id=0, speculative=config)
    writer = StepMetadataWriter(sched.rows, blocks, None, speculative=spec)
    staging = StagingPair(8192, ROWS, 32, pinned=False)
    sim = SimExecutor(SIM, 49152, 0, ROWS, speculative=spec)
    rng = np.random.default_rng(0)
    for i in range(ROWS):
        sched.add(Request(str(i), i, rng.integers(300, 20000, 32).tolist(),
                          SamplingParams(max_tokens=400, ignore_eos=True), i, 0.0))
    spent = dict.fromkeys(("schedule", "write", "apply", "sim_device"), 0.0)
    for step in range(STEPS):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        buffer = staging.next_buffer()
        buffer.fence.wait()
        buffer.fence.arm()
        meta = writer.write(plan, buffer)
        t2 = time.perf_counter()
        sched.release_drained(plan)
        t3 = time.perf_counter()
        result = sim._run(meta, StepHandle(plan.step_id, time.perf_counter()))  # the device thread's step, unthreaded
        t4 = time.perf_counter()
        if result.num_emitted is not None:
            sched.apply_verified(plan, result.token_ids, result.num_emitted, result.finite)
        else:
            sched.apply(plan, result.token_ids, result.finite)
        t5 = time.perf_counter()
        if step >= WARM:
            for key, seconds in (("schedule", t1 - t0), ("write", t2 - t1), ("sim_device", t4 - t3),
                                 ("apply", t5 - t4)):
                spent[key] += seconds
    sim.close()
    return {k: v / (STEPS - WARM) * 1e3 for k, v in spent.items()}


def frontend(spec: bool) -> float:
    """ms per step of output processing, replaying steps 20..100 of an in-process run (no finishes in them)."""
    captured = []
    real = OutputProcessor.process

    def capture(self, out):
        captured.append(copy.deepcopy(out))
        real(self, out)

    kwargs = {"speculative_config": {"disable_by_batch_size": None}} if spec else {}
    OutputProcessor.process = capture  # before the engine binds its processor's method
    try:
        llm = LLM("smollm2-135m", device="sim", max_num_seqs=ROWS, engine_process=False, overlap=False,
                  sim=SimConfig(step_fixed_ms=0.001, per_token_us=0.0, per_context_token_ns=0.0), **kwargs)
    finally:
        OutputProcessor.process = real
    with llm:
        items = uniform_requests(ROWS, (32, 32), (400, 400), llm.tokenizer.vocab_size, seed=0)
        params = [SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, seed=i) for i in range(ROWS)]
        llm.generate([it.prompt_token_ids for it in items], params, use_tqdm=False)
        seqs = sorted({int(s) for out in captured for s in out.seqs.tolist()})
        handles = {seq: RequestHandle(seq, f"r{seq}", None, items[k].prompt_token_ids,
                                      IncrementalDetokenizer(llm.tokenizer, items[k].prompt_token_ids),
                                      StopStringMatcher(params[k].stop_strings, params[k].include_stop_str_in_output),
                                      RequestMetrics(arrival_time=0.0)) for k, seq in enumerate(seqs)}
        processor = OutputProcessor(handles, Timeline(), frozenset({llm.tokenizer.eos_token_id}), lambda m: None,
                                    False)
    steps = [m for m in captured if m.record is not None]
    for out in steps[:20]:
        processor.process(out)
    start = time.perf_counter()
    for out in steps[20:100]:
        processor.process(out)
    return (time.perf_counter() - start) / 80 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for spec in (False, True):
        runs = [{**planner_and_device(spec), "frontend": frontend(spec)} for _ in range(args.repeats)]
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        print(("verify (depth 4)" if spec else "plain") + ":", "  ".join(f"{k} {v:.3f}" for k, v in best.items()),
              "ms/step")


if __name__ == "__main__":
    main()
