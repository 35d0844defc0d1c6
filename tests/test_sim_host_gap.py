"""The sim device prepares a grammar step, launched while the step before it ran, once the planner's fill has
entered the grammar library (``SimExecutor._wait_for_host_gap``); never later than the step's modelled end."""

from __future__ import annotations

import threading
import time
import types

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.engine.step_contract import GrammarMask
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
