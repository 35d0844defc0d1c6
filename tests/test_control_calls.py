"""Typed control calls: every call has a handler and is answered with its reply type, in both engine modes;
a handler's exception reaches the caller as its own type (``RemoteError`` when it cannot travel)."""

from __future__ import annotations

import pickle

import pytest

from asyncbatch import SamplingParams, SimConfig
from asyncbatch.engine import control as c
from asyncbatch.engine.block_manager import IntegrityError
from asyncbatch.engine.core_control import ControlHandler

FAST_SIM = SimConfig(step_fixed_ms=0.2, output_len_min=4, output_len_max=40)
CALL_TYPES = [v for v in vars(c).values() if isinstance(v, type) and issubclass(v, c.ControlCall)
              and v is not c.ControlCall]


def test_every_call_type_names_its_reply_and_has_a_handler():
    registry = ControlHandler.__dict__["answer"].dispatcher.registry
    assert len(CALL_TYPES) == 12
    for call_type in CALL_TYPES:
        assert call_type.reply_type is not object, call_type
        assert call_type in registry, f"the core has no handler for {call_type.__name__}"
    assert c.NumFreeBlocks.reply_type is int and c.PrefixCacheKeys.reply_type is list
    assert c.SetNvtx.reply_type is type(None) and c.CountRangesStop.reply_type is c.RangeCounts


@pytest.mark.parametrize("engine_process", [True, False])
def test_each_call_is_answered_with_its_reply_type(make_llm, engine_process):
    llm = make_llm(device="sim", sim=FAST_SIM, engine_process=engine_process, enable_prefix_caching=True)
    llm.generate([[5, 6, 7, 8] * 8] * 3, SamplingParams(max_tokens=6), use_tqdm=False)
    calls = [c.SetNvtx(False), c.CountRangesStart(), c.CountRangesStop(), c.CheckIntegrity(), c.NumFreeBlocks(),
             c.NumPreemptions(), c.PrefixCacheStats(), c.PrefixCacheKeys(8), c.ResetPrefixCache(), c.LastLaunchedStep(),
             c.NumLiveRequests(), c.DescribeExecutor()]
    assert {type(call) for call in calls} == set(CALL_TYPES)
    replies = {type(call): llm._client.call(call) for call in calls}
    for call_type, value in replies.items():
        assert isinstance(value, call_type.reply_type), (call_type, value)
    assert replies[c.NumFreeBlocks] == llm.num_usable_blocks
    assert replies[c.NumLiveRequests] == 0
    assert replies[c.LastLaunchedStep] >= 1
    assert replies[c.PrefixCacheStats]["enabled"] is True


@pytest.mark.parametrize("engine_process", [True, False])
def test_a_handler_exception_is_raised_as_its_own_type_and_the_engine_goes_on(make_llm, engine_process):
    llm = make_llm(device="sim", sim=FAST_SIM, engine_process=engine_process, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="invalid literal") as raised:
        llm._client.call(c.PrefixCacheKeys("many"))  # int("many") in the core
    assert any("raised in the engine core" in note for note in raised.value.__notes__)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0].finish_reason
    llm.check_integrity()


def test_an_integrity_error_is_caught_as_integrity_error(make_llm):
    llm = make_llm(device="sim", sim=FAST_SIM, engine_process=False)
    free_rows = llm._core.scheduler._free_rows
    free_rows.append(free_rows[-1])  # a token row on the free list twice
    try:
        with pytest.raises(IntegrityError, match="held twice"):
            llm.check_integrity()
    finally:
        free_rows.pop()
    llm.check_integrity()


class _TwoArgs(Exception):
    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")  # ``args`` cannot rebuild it: unpickling fails


def test_an_exception_that_does_not_pickle_travels_as_remote_error():
    try:
        raise _TwoArgs("cannot", "travel")
    except _TwoArgs as exc:
        reply = pickle.loads(pickle.dumps(c.Reply.failed(7, exc)))
    with pytest.raises(c.RemoteError) as raised:
        reply.result()
    error = raised.value
    assert error.type_name.endswith("_TwoArgs") and error.message == "cannot: travel"
    assert "_TwoArgs" in error.remote_traceback and str(error) == f"{error.type_name}: cannot: travel"


def test_a_reply_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="NumFreeBlocks must be answered with int"):
        c.NumFreeBlocks().check_reply("12")
