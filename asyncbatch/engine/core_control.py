"""The engine core's side of the control calls (``engine.control``): one handler per call type.

Handlers run on the planner thread, between two steps (``EngineCore`` hands
them each ``Call`` from its inbox), so they read and change the scheduler with
no lock. ``answer`` dispatches on the call's type; a call type without a
handler is a ``TypeError`` sent back to its caller, like any exception a
handler raises (``Reply.failed``): the engine goes on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

from asyncbatch.engine.control import (
    Call,
    CheckIntegrity,
    ControlCall,
    CountRangesStart,
    CountRangesStop,
    DescribeExecutor,
    LastLaunchedStep,
    NumFreeBlocks,
    NumLiveRequests,
    NumPreemptions,
    PrefixCacheKeys,
    PrefixCacheStats,
    RangeCounts,
    Reply,
    ResetPrefixCache,
    SetNvtx,
)
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.executors.base import Executor
from asyncbatch.profiling.marks import RangeCounter, count_ranges, enable_nvtx


class CoreView(Protocol):
    """What the handlers read of ``EngineCore`` (a protocol: the core imports this module)."""

    scheduler: Scheduler
    executor: Executor
    last_launched_step: int  # the newest launched step's id (0 before the first)

    @property
    def num_live_requests(self) -> int: ...


class ControlHandler:
    """Answers ``Call`` messages for ``core``; owns the NVTX range count open between start and stop calls."""

    def __init__(self, core: CoreView, send: Callable[[object], None]) -> None:
        self._core = core
        self._send = send
        self._range_count = None  # an open ``count_ranges`` context, between CountRangesStart and CountRangesStop
        self._range_counter: RangeCounter | None = None

    def handle(self, message: Call) -> None:
        """Send the reply to ``message``: the handler's value, or the exception it raised."""
        try:
            value = self.answer(message.call)
            message.call.check_reply(value)
        except Exception as exc:  # noqa: BLE001 - the caller re-raises it; the engine goes on
            self._send(Reply.failed(message.call_id, exc))
        else:
            self._send(Reply(message.call_id, value))

    @functools.singledispatchmethod
    def answer(self, call: ControlCall) -> object:
        raise TypeError(f"the engine core has no handler for {type(call).__name__}")

    @answer.register
    def _set_nvtx(self, call: SetNvtx) -> None:
        enable_nvtx(bool(call.on))

    @answer.register
    def _count_ranges_start(self, call: CountRangesStart) -> None:
        self._range_count = count_ranges()
        self._range_counter = self._range_count.__enter__()

    @answer.register
    def _count_ranges_stop(self, call: CountRangesStop) -> RangeCounts:
        self._range_count.__exit__(None, None, None)
        return RangeCounts(*self._range_counter.counts())

    @answer.register
    def _check_integrity(self, call: CheckIntegrity) -> None:
        self._core.scheduler.check_integrity()

    @answer.register
    def _num_free_blocks(self, call: NumFreeBlocks) -> int:
        scheduler = self._core.scheduler
        scheduler.settle_if_idle()  # while requests run, parked blocks count as used until settled
        return int(scheduler.blocks.num_free_blocks)

    @answer.register
    def _num_preemptions(self, call: NumPreemptions) -> int:
        return int(self._core.scheduler.num_preemptions)

    @answer.register
    def _prefix_cache_stats(self, call: PrefixCacheStats) -> dict:
        return self._core.scheduler.prefix_cache_stats()

    @answer.register
    def _prefix_cache_keys(self, call: PrefixCacheKeys) -> list[int]:
        return self._core.scheduler.prefix_cache_keys(call.max_blocks)

    @answer.register
    def _reset_prefix_cache(self, call: ResetPrefixCache) -> bool:
        return bool(self._core.scheduler.reset_prefix_cache())

    @answer.register
    def _last_launched_step(self, call: LastLaunchedStep) -> int:
        return self._core.last_launched_step

    @answer.register
    def _num_live_requests(self, call: NumLiveRequests) -> int:
        return self._core.num_live_requests

    @answer.register
    def _describe_executor(self, call: DescribeExecutor) -> dict:
        return self._core.executor.describe()
