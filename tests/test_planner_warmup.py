"""The planner warm-up (``engine/planner_warmup.py``): it runs the admission path's functions often enough for the
interpreter to specialise them, on objects of its own, and leaves the engine it warms as it found it."""

from __future__ import annotations

import gc
import logging
import weakref
from collections import Counter

import pytest

from asyncbatch.config import EngineConfig, SimConfig
from asyncbatch.engine import (
    admission,
    block_manager,
    planner_warmup,
    prefix_sharing,
    row_state,
    step_metadata,
)
from asyncbatch.engine import core as core_module
from asyncbatch.engine.core import planner_writer
from asyncbatch.sampling_params import SamplingParams

# CPython 3.11 quickens a function after 8 calls (3.12+ specialises each instruction after fewer runs).
SPECIALISE_AFTER = 8


@pytest.mark.parametrize("block_size, max_num_seqs, budget, caching",
                         [(16, 256, 2048, True), (16, 8, 512, False), (16, 1024, 8192, True), (1, 4, 16, True)])
def test_the_warmup_runs_each_admission_function_enough_times(monkeypatch, block_size: int, max_num_seqs: int,
                                                              budget: int, caching: bool) -> None:
    calls: Counter[str] = Counter()

    def counting(owner: object, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in ((admission.Admitter, "_apply"), (admission.Admitter, "_admit_run"),
                        (admission.Admitter, "_new_prompt_run"), (row_state.RowState, "admit_many"),
                        (block_manager.BlockManager, "allocate_admitted"), (prefix_sharing.PrefixSharer, "share")):
        counting(owner, name)
    counting(step_metadata, "write_prefill")
    report = planner_warmup.warm_up_planner(block_size, max_num_seqs, budget, caching,
                                            lambda scheduler: planner_writer(scheduler, 49152), eos_token_id=2)
    for name in ("_apply", "_admit_run", "_new_prompt_run", "admit_many", "allocate_admitted", "write_prefill"):
        assert calls[name] >= SPECIALISE_AFTER, (name, calls)
    # Each admitting step applies its admissions, in the small rounds each run of new prompts apart.
    assert calls["_apply"] >= report.admitting_steps
    assert report.steps > report.admitting_steps
    # One step admits as many requests as the token budget holds (the burst-sized temporaries), up to 256 rows.
    prompt_len = planner_warmup.PROMPT_BLOCKS * block_size
    assert report.admitted >= min(max_num_seqs, 256, budget // prompt_len) + planner_warmup.SMALL_ROUNDS
    if caching:
        assert calls["share"] > 0  # the cache-hit path ran too
    assert report.seconds > 0


def test_an_engine_that_warmed_up_serves_as_one_that_did_not(make_llm) -> None:
    """The warm-up ran in the engine's planner thread before it served anything, and none of it reached the
    engine's own scheduler: its prefix cache counted only the prompts served, every block is free after them,
    and the tokens equal those of an engine without a warm-up."""
    sim = SimConfig(step_fixed_ms=0.05, per_token_us=0.0, per_context_token_ns=0.0)
    prompts = [[300 + 7 * i + j for j in range(40 + i)] for i in range(24)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    tokens = {}
    for warm in (True, False):
        llm = make_llm(device="sim", sim=sim, engine_process=False, max_num_seqs=16, planner_warmup=warm,
                       debug_check_integrity=True)
        tokens[warm] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.wait_settled(5.0)
        llm.check_integrity()
        report = llm._core.planner_warmup
        assert (report is not None and report.admitted > 0) if warm else report is None
        assert llm.num_free_blocks == llm.num_usable_blocks
        assert llm._core.scheduler.prefix_cache_stats()["prompt_tokens"] == sum(len(p) for p in prompts)
        assert sum(r.num_admitted for r in llm.timeline.window()) == len(prompts)
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("collecting", [True, False])
def test_the_warmup_frees_its_planner_and_restores_the_collector(monkeypatch, collecting: bool) -> None:
    """The throwaway planner holds reference cycles; the warm-up frees them itself (one young-generation pass)
    and leaves the collector as it found it, on or off."""
    made: list[weakref.ref] = []

    class Recorded(planner_warmup.Scheduler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(planner_warmup, "Scheduler", Recorded)
    was = gc.isenabled()
    (gc.enable if collecting else gc.disable)()
    try:
        planner_warmup.warm_up_planner(16, 64, 2048, True, lambda scheduler: planner_writer(scheduler, 1000))
        assert gc.isenabled() is collecting
    finally:
        (gc.enable if was else gc.disable)()
    assert len(made) == 1 and made[0]() is None


def test_a_failed_warmup_leaves_the_engine_serving(make_llm, monkeypatch, caplog) -> None:
    """The warm-up is a rehearsal on objects of its own: if it raises, the engine logs it and serves as usual."""
    def broken(*args, **kwargs):
        raise RuntimeError("rehearsal broke")

    monkeypatch.setattr(core_module, "warm_up_planner", broken)
    sim = SimConfig(step_fixed_ms=0.05, per_token_us=0.0, per_context_token_ns=0.0)
    with caplog.at_level(logging.WARNING, logger="asyncbatch.engine.core"):
        llm = make_llm(device="sim", sim=sim, engine_process=False, max_num_seqs=4)
        out = llm.generate([[300, 301, 302]], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and llm._core.planner_warmup is None
    assert any("planner warm-up failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_planner_warmup_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="planner_warmup"):
        EngineConfig(device="sim", planner_warmup="yes")
