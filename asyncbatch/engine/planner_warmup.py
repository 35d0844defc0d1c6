"""A fresh planner's first admission burst at the price of its later ones: rehearse on throwaway planner objects.

A fresh process's first burst of 256 arrivals cost a median 7.2 us of planner CPU an admitted request where its
later bursts cost 5.3-5.9 (an engine-sized planner rig: 256 rows, 2,048 tokens a step, 32-token prompts; eight
fresh processes each way, ``profiles/admission-burst-amd-epyc-2core``, session-2026-12-05-d); after this warm-up
the first burst cost 6.0. Two things are new in a fresh process, and neither depends on which planner objects
run:

* CPython 3.11+ specialises a function's bytecode only after it has run a few times; the admission path's
  functions (``Admitter.admit``, ``write_prefill``, ``RowState.admit_many``, ...) run once a step, so the first
  steps that admit anything run them generic;
* the burst-sized temporaries (2,048-token arrays, tables of 64 rows) grow the planner thread's heap the first
  time, a page fault for each new page.

So the planner thread, before it serves anything, runs a few rounds of synthetic requests through a scheduler,
metadata writer and staging pair of its own, shaped like the engine's (its token budget, block size and prefix
caching; fewer rows and blocks), on the same code: one burst as large as one step admits, then small rounds,
half of their prompts sharing a cached first block (the cache-hit path). Nothing of the engine's own state is
read or written. The throwaway objects hold reference cycles (~600 objects and a few MB of arrays), so the
rehearsal runs with the collector paused and ends with a collection of the youngest generation, which holds
them all: ~0.2 ms, where a full ``gc.collect`` walks an in-process engine's whole heap (~0.1 s with torch
loaded). It costs ~10-35 ms of the core's start (``PlannerWarmup.seconds``). ``EngineConfig.planner_warmup=False``
skips it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from asyncbatch.engine.admission import Admitter
from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.engine.step_metadata import StepMetadataWriter
from asyncbatch.sampling_params import SamplingParams

MAX_ROWS = 256  # the throwaway planner's token rows: a burst larger than a step admits gains nothing more
SMALL_ROUNDS = 12  # rounds of a few requests after the large one: >= 13 admitting steps (3.11 quickens after 8)
SMALL_BURST = 4
PROMPT_BLOCKS = 2  # each synthetic prompt fills this many blocks (so they register, and later ones hit them)
FIRST_TOKEN = 1000  # synthetic token ids start here (any ids the planner accepts; no tokenizer reads them)


@dataclass(frozen=True, slots=True)
class PlannerWarmup:
    """What a warm-up ran: planner steps, of them those that admitted requests, requests admitted, wall seconds."""

    steps: int
    admitting_steps: int
    admitted: int
    seconds: float


def warm_up_planner(block_size: int, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool,
                    make_writer: Callable[[Scheduler], StepMetadataWriter], eos_token_id: int | None = None,
                    seed: int = 0) -> PlannerWarmup:
    """Rehearse admissions on a throwaway planner shaped like an engine's (``block_size``, at most ``MAX_ROWS``
    of its ``max_num_seqs`` rows, its ``max_num_batched_tokens`` and ``prefix_caching``); ``make_writer`` builds
    the metadata writer as the engine does for its own scheduler. Run it on the thread that will plan (the
    heap it grows is that thread's)."""
    started = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # nothing of the rehearsal leaves the youngest generation: one cheap pass frees it below
    try:
        steps, admitting, admitted = _rehearse(block_size, max_num_seqs, max_num_batched_tokens, prefix_caching,
                                               make_writer, eos_token_id, seed)
    finally:
        if collecting:
            gc.enable()
    gc.collect(0)
    return PlannerWarmup(steps, admitting, admitted, time.perf_counter() - started)


def _rehearse(block_size: int, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool,
              make_writer: Callable[[Scheduler], StepMetadataWriter], eos_token_id: int | None,
              seed: int) -> tuple[int, int, int]:
    """``warm_up_planner``'s rounds: (planner steps, those that admitted, requests admitted)."""
    prompt_len = PROMPT_BLOCKS * block_size
    rows = max(1, min(max_num_seqs, MAX_ROWS))
    burst = max(1, min(rows, max_num_batched_tokens // prompt_len))  # requests one step admits whole
    max_blocks = PROMPT_BLOCKS + 2  # a prompt and its two outputs (a block each where blocks hold one token)
    # Room for the large round plus one small round: the small rounds reuse what the earlier ones left cached
    # (and evict some where blocks are small or rows few; a fresh engine's first burst evicts nothing).
    blocks = BlockManager((burst + SMALL_BURST) * max_blocks + 1, block_size, rows, max_blocks,
                          prefix_caching=prefix_caching)
    scheduler = Scheduler(blocks, max_num_batched_tokens, eos_token_id=eos_token_id)
    writer = make_writer(scheduler)
    staging = StagingPair(max_num_batched_tokens, rows, max_blocks, pinned=False)
    token = np.full(rows, FIRST_TOKEN - 1, dtype=np.int64)  # every sampled token: not EOS (ignore_eos anyway)
    finite = np.ones(rows, dtype=bool)
    rng = np.random.default_rng(seed)
    shared = rng.integers(FIRST_TOKEN, FIRST_TOKEN + 30000, block_size).tolist()  # a prefix the small rounds share
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    steps = admitting = admitted = seq = 0
    for k, round_size in enumerate((burst, *(SMALL_BURST,) * SMALL_ROUNDS)):
        # The large round (half its prompts share a first block, so no run of new prompts is long enough) is the
        # general pass at a burst's size; in the small rounds every run of new prompts, however short, is admitted
        # as one (``Admitter._admit_run``; the engine's takes runs of 16 and more), so each round rehearses both.
        scheduler.admitter.min_new_run = 1 if k else Admitter.MIN_NEW_RUN
        for i in range(round_size):
            tail = rng.integers(FIRST_TOKEN, FIRST_TOKEN + 30000, prompt_len - (block_size if i % 2 else 0))
            prompt = (shared + tail.tolist()) if i % 2 else tail.tolist()
            scheduler.add(Request(f"warmup-{seq}", seq, prompt, params, seq, 0.0))
            seq += 1
        while scheduler.has_work():
            plan = scheduler.schedule()
            meta = writer.write(plan, staging.next_buffer())
            scheduler.release_drained(plan)
            scheduler.apply(plan, token[:meta.num_sampled], finite[:meta.num_sampled])
            steps += 1
            admitting += plan.num_admitted > 0
            admitted += plan.num_admitted
        scheduler.settle_released()
    return steps, admitting, admitted
