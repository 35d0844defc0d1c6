"""Control calls: typed questions the frontend asks the engine core between two steps.

    caller's thread                                      planner thread (between two steps)
      client.call(NumFreeBlocks()) ── Call(id, NumFreeBlocks()) ──►  ControlHandler.answer: one method per type
        waits for its reply        ◄── Reply(id, value | error) ────  the handler's value, or what it raised
      returns the value (an ``int``), or raises the remote exception as its own type

Each call is a frozen dataclass generic in its reply type: ``NumFreeBlocks`` is a
``ControlCall[int]`` and ``reply_type`` names ``int`` at run time, so the core
refuses (with ``TypeError``) to send a reply of another type. A call carries
its arguments as fields and nothing else; ``Call`` adds the id its ``Reply``
answers to.

An exception raised by a handler travels as itself (pickled across the pipe of
a core process) and is raised again in the caller as its own type, with the
core's traceback as a note: ``check_integrity`` raises ``IntegrityError`` on
both sides. One that does not survive a pickle round trip becomes a
``RemoteError`` carrying its type's name, message and traceback. The core goes
on either way: a failed call is the caller's error, not the engine's.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import ClassVar, Generic, NamedTuple, TypeVar, get_args, get_origin

R = TypeVar("R")


class ControlCall(Generic[R]):
    """A question for the planner thread whose answer is an ``R`` (``reply_type``, read from the base)."""

    __slots__ = ()
    reply_type: ClassVar[type] = object

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if get_origin(base) is ControlCall:
                (reply,) = get_args(base)
                cls.reply_type = type(None) if reply is None else get_origin(reply) or reply

    def check_reply(self, value: object) -> None:
        """Raise ``TypeError`` unless ``value`` is a ``reply_type`` (a handler's bug, reported to the caller)."""
        if not isinstance(value, self.reply_type):
            raise TypeError(f"{type(self).__name__} must be answered with {self.reply_type.__name__}, "
                            f"got {type(value).__name__}")


class RangeCounts(NamedTuple):
    """``RangeCounter.counts()`` of the core's process: what ``RangeCounter.add_counts`` folds in."""

    stage_ranges: int
    step_ranges: int
    by_name: dict[str, int]


# -- the calls (one type each; the reply type is the base's parameter) ------------------------------
@dataclass(frozen=True, slots=True)
class SetNvtx(ControlCall[None]):
    """NVTX ranges on or off in the core's process."""

    on: bool


@dataclass(frozen=True, slots=True)
class CountRangesStart(ControlCall[None]):
    """Count the core's NVTX ranges until ``CountRangesStop`` (the frontend's ``count_ranges``)."""


@dataclass(frozen=True, slots=True)
class CountRangesStop(ControlCall[RangeCounts]):
    """Stop the count ``CountRangesStart`` opened and return it."""


@dataclass(frozen=True, slots=True)
class CheckIntegrity(ControlCall[None]):
    """Raise ``IntegrityError`` if KV block or token-row accounting is inconsistent."""


@dataclass(frozen=True, slots=True)
class NumFreeBlocks(ControlCall[int]):
    pass


@dataclass(frozen=True, slots=True)
class NumPreemptions(ControlCall[int]):
    """Preemptions since the core started."""


@dataclass(frozen=True, slots=True)
class PrefixCacheStats(ControlCall[dict]):
    """``Scheduler.prefix_cache_stats()``: enabled, prompt_tokens, cached_tokens, hit_rate, cached_blocks,
    evictions."""


@dataclass(frozen=True, slots=True)
class PrefixCacheKeys(ControlCall[list[int]]):
    """Chain keys of up to ``max_blocks`` cached KV blocks, held ones first."""

    max_blocks: int = 4096


@dataclass(frozen=True, slots=True)
class ResetPrefixCache(ControlCall[bool]):
    """Forget every cached block no running request uses; True if the cache is now empty."""


@dataclass(frozen=True, slots=True)
class LastLaunchedStep(ControlCall[int]):
    """The id of the newest launched step (0 before the first)."""


@dataclass(frozen=True, slots=True)
class NumLiveRequests(ControlCall[int]):
    """Requests the core has and has not ended yet."""


@dataclass(frozen=True, slots=True)
class DescribeExecutor(ControlCall[dict]):
    """``Executor.describe()``, read now (CUDA graph counters move as steps run)."""


# -- the envelope ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Call:
    """``call``, to be answered by the ``Reply`` with the same ``call_id``."""

    call_id: int
    call: ControlCall


class RemoteError(Exception):
    """An exception raised in the engine core that could not travel as itself (it does not pickle)."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(type_name, message, remote_traceback)  # all in ``args``, so this one pickles
        self.type_name, self.message, self.remote_traceback = type_name, message, remote_traceback

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


@dataclass(slots=True)
class Reply:
    """The answer to one ``Call``: its value, or the exception its handler raised (``error`` set)."""

    call_id: int
    value: object = None
    error: BaseException | None = None
    remote_traceback: str = ""

    @classmethod
    def failed(cls, call_id: int, exc: BaseException) -> Reply:
        """The reply for a handler that raised ``exc`` (call it in the ``except`` block: it reads the traceback)."""
        text = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 - anything that stops the round trip: send what survives it
            exc = RemoteError(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text)
        return cls(call_id, error=exc, remote_traceback=text)

    def result(self) -> object:
        """The value; or raise the remote exception, as its own type, with the core's traceback as a note."""
        if self.error is None:
            return self.value
        error = self.error
        if self.remote_traceback and self.remote_traceback not in getattr(error, "__notes__", ()):
            error.add_note(f"raised in the engine core:\n{self.remote_traceback}")
        raise error
