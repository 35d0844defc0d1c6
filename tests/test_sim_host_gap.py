"""The sim device keeps its own host work (the simulation's bookkeeping, which a real device does not put on the
host) out of the planner's way: it prepares a grammar step, launched while the step before it ran, once the
planner's fill has entered the grammar library (``SimExecutor._wait_for_host_gap``), never later than the step's
modelled end; and with the mask in early it picks the grammar rows' tokens once the planner blocks on the step
(``StepHandle.mark_awaited``), else at the modelled end."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest
from sim_steps import one_row_step

from asyncbatch.config import SimConfig
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.engine.step_contract import GrammarMask, StepMeta
from asyncbatch.executors import sim_executor
from asyncbatch.executors.base import StepHandle
from asyncbatch.executors.sim_executor import SimExecutor


def a_step(step_ms: float, grammar: GrammarMask | None) -> tuple[SimExecutor, object, StepHandle]:
    sim = SimExecutor(SimConfig(step_fixed_ms=step_ms, per_token_us=0.0, per_context_token_ns=0.0), 1000, 2, 8)
    meta = types.SimpleNamespace(step_id=1, num_tokens=4, context_tokens=40,
                                 extras=types.SimpleNamespace(grammar=grammar))
    return sim, meta, StepHandle(1, time.perf_counter())


def mask() -> GrammarMask:
    return GrammarMask(np.arange(2), np.arange(2), np.zeros((2, 32), dtype=np.int32))


def test_it_waits_for_the_fill_to_begin():
    grammar = mask()
    sim, meta, handle = a_step(2000.0, grammar)
    try:
        begun = threading.Timer(0.1, grammar.begin_fill)
        begun.start()
        t0 = time.perf_counter()
        sim._wait_for_host_gap(meta, handle)
        waited = time.perf_counter() - t0
        assert 0.05 < waited < 1.5  # woken by begin_fill, long before the 2 s step ends
        assert not grammar.ready
    finally:
        sim.close()


def test_a_ready_mask_or_a_step_without_grammar_does_not_wait():
    grammar = mask()
    grammar.set_ready(time.perf_counter())  # e.g. masks filled before the launch (grammar_mask_overlap=False)
    for g in (grammar, None):
        sim, meta, handle = a_step(5000.0, g)
        try:
            t0 = time.perf_counter()
            sim._wait_for_host_gap(meta, handle)
            assert time.perf_counter() - t0 < 1.0
        finally:
            sim.close()


def test_a_fill_that_never_begins_holds_the_preparation_no_later_than_the_modelled_end():
    sim, meta, handle = a_step(150.0, mask())
    try:
        sim._wait_for_host_gap(meta, handle)
        assert time.perf_counter() >= handle.launch_time + 0.15
    finally:
        sim.close()


def grammar_step(allowed: int) -> tuple[StepMeta, GrammarMask]:
    """A one-row decode step whose row may only take token ``allowed``."""
    bitmask = np.zeros((1, 32), dtype=np.int32)
    bitmask[0, allowed // 32] = np.int32(np.uint32(1 << (allowed % 32)).view(np.int32))
    grammar = GrammarMask(np.zeros(1, dtype=np.int64), np.array([5]), bitmask)
    meta = one_row_step(StagingPair(64, 4, 8, pinned=False).next_buffer())
    meta.extras = types.SimpleNamespace(grammar=grammar, bias=None, logprobs=None, prompt_logprobs=None)
    return meta, grammar


@pytest.mark.parametrize("await_after_s", [0.1, None])
def test_an_early_mask_is_picked_from_once_the_planner_waits_or_at_the_modelled_end(monkeypatch, await_after_s):
    picked: list[float] = []
    real_pick = sim_executor.chain_or_pick
    monkeypatch.setattr(sim_executor, "chain_or_pick",
                        lambda *a: (picked.append(time.perf_counter()), real_pick(*a))[1])
    executor = SimExecutor(SimConfig(step_fixed_ms=400.0, per_token_us=0.0, per_context_token_ns=0.0), 1000, 2, 4)
    try:
        meta, grammar = grammar_step(allowed=777)
        grammar.set_ready(time.perf_counter())  # filled before the step's forward ends
        handle = executor.launch(meta)
        end = handle.launch_time + 0.4
        if await_after_s is None:  # the planner never blocks on it before the end
            while not handle.is_done():
                time.sleep(0.01)
            assert picked and picked[0] >= end - 1e-3
        else:
            time.sleep(await_after_s)
            assert not picked  # the planner is busy: the pick waits
            awaited = time.perf_counter()
            result = executor.wait(handle)
            assert picked and awaited <= picked[0] < end  # before the end, once the planner waits
            assert time.perf_counter() >= end  # still delivered at the modelled end
            assert result.token_ids.tolist() == [777] and result.device_end == pytest.approx(end, abs=1e-6)
    finally:
        executor.close()
