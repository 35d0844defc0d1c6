"""NVTX ranges for Nsight Systems, in the ``asyncbatch`` domain.

``mark`` is a shared no-op context manager unless NVTX is enabled
(``ASYNCBATCH_NVTX=1`` or ``enable_nvtx(True)``) and the ``nvtx`` package
imports, so the launch path pays one global read per range when off. When on
but no tool (Nsight Systems) is attached, ``nvtx`` hands out a dummy domain
whose calls return at once; ``measure_mark_overhead`` times both cases.

Two kinds of range, named like the timeline's fields so both pictures agree:

* stage ranges, ``mark(name, step_id, detail)``: push/pop on the calling
  thread. The message is ``name + detail`` and the step number is the range's
  integer payload, so ``nsys stats --report nvtx_sum`` groups by stage (keep
  ``detail`` to a small set, e.g. the CUDA-graph bucket or " eager").
* step ranges, ``step_begin(...)``/``step_end(token)``: one start/end range per
  step, from planning to applying its tokens, whose message carries the step
  number and batch shape ("step 12 decode=64 prefill=0 tokens=64"). Start/end
  ranges may overlap (steps N and N+1 are both open in overlap mode).

The ``nvtx`` package registers and caches every distinct message forever;
per-step messages would grow that cache without bound, so it is emptied every
``_MESSAGE_CACHE_LIMIT`` ranges (a message seen again is registered again,
which the profiler handles; nothing here keeps a registered handle).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

_DOMAIN = "asyncbatch"
_MESSAGE_CACHE_LIMIT = 1 << 16
_nvtx = None  # the imported module, or None
_domain = None  # an nvtx Domain (tool attached), its DummyDomain, or a _CountingDomain
_enabled = False
_messages = 0  # ranges opened since nvtx's message cache was last emptied


def enable_nvtx(on: bool = True) -> bool:
    """Turn ranges on or off; returns whether they are on (False if ``nvtx`` is missing)."""
    global _nvtx, _domain, _enabled
    if on and _nvtx is None:
        try:
            import nvtx as module
        except ImportError:
            module = None
        _nvtx = module
    if on and _nvtx is not None and _domain is None:
        _domain = _nvtx.get_domain(_DOMAIN)
    _enabled = bool(on and _domain is not None)
    return _enabled


def nvtx_enabled() -> bool:
    return _enabled


def nvtx_tool_attached() -> bool:
    """Whether a profiler (e.g. ``nsys``) collects this process's NVTX ranges."""
    try:
        import nvtx
    except ImportError:
        return False
    return type(nvtx.get_domain(_DOMAIN)).__name__ != "DummyDomain"


class _Range:
    """A push/pop range; holds its domain so a toggle mid-range still pops what it pushed."""

    __slots__ = ("_attributes", "_domain")

    def __init__(self, domain, attributes) -> None:
        self._domain = domain
        self._attributes = attributes

    def __enter__(self) -> None:
        self._domain.push_range(self._attributes)

    def __exit__(self, *exc: object) -> bool:
        self._domain.pop_range()
        return False


class _NullRange:
    """The range when NVTX is off: a slotted class with a fixed-arity ``__exit__`` (faster than nullcontext)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        return None


_NULL = _NullRange()


def _attributes(domain, message: str, step_id: int | None):
    """Event attributes for a range; every ``_MESSAGE_CACHE_LIMIT`` calls, empty nvtx's string cache."""
    global _messages
    _messages += 1  # racy across threads, and only a trigger: an occasional lost count does not matter
    if _messages >= _MESSAGE_CACHE_LIMIT:
        _messages = 0
        clear = getattr(getattr(type(domain), "get_registered_string", None), "cache_clear", None)
        if clear is not None:
            clear()
    return domain.get_event_attributes(message=message, payload=step_id)


def mark(name: str, step_id: int | None = None, detail: str = ""):
    """A stage range on this thread: ``with mark("forward", step_id, " bucket=64"): ...``."""
    if not _enabled:
        return _NULL
    domain = _domain
    return _Range(domain, _attributes(domain, name + detail, step_id))


def step_begin(step_id: int, num_decode: int, num_prefill: int, num_tokens: int) -> object:
    """Open the step's range (any thread may close it); returns the token for ``step_end``."""
    if not _enabled:
        return None
    domain = _domain
    message = f"step {step_id} decode={num_decode} prefill={num_prefill} tokens={num_tokens}"
    return (domain, domain.start_range(_attributes(domain, message, step_id)))


def step_end(token: object) -> None:
    if token is not None:
        domain, range_id = token
        domain.end_range(range_id)


# -- measurement ---------------------------------------------------------------
class _NullDomain:
    """Stands in for ``nvtx``'s domain where the package is missing (counting only)."""

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return None

    def push_range(self, attributes=None) -> None: ...

    def pop_range(self) -> None: ...

    def start_range(self, attributes=None) -> int:
        return 0

    def end_range(self, range_id) -> None: ...


class RangeCounter:
    """Counts of the ranges opened while ``count_ranges`` was active, per message stem."""

    def add_counts(self, stage_ranges: int, step_ranges: int, by_name: dict[str, int]) -> None:
        """Fold in counts taken elsewhere (the engine core's process)."""
        with self._lock:
            self.stage_ranges += stage_ranges
            self.step_ranges += step_ranges
            for name, n in by_name.items():
                self.by_name[name] = self.by_name.get(name, 0) + n

    def counts(self) -> tuple[int, int, dict[str, int]]:
        with self._lock:
            return self.stage_ranges, self.step_ranges, dict(self.by_name)

    def __init__(self) -> None:
        self.stage_ranges = 0
        self.step_ranges = 0
        self.by_name: dict[str, int] = {}
        self._lock = threading.Lock()

    def _add(self, message: str | None, step: bool) -> None:
        stem = (message or "").split(" ", 1)[0]
        with self._lock:
            if step:
                self.step_ranges += 1
            else:
                self.stage_ranges += 1
            self.by_name[stem] = self.by_name.get(stem, 0) + 1


class _CountingDomain:
    """Forwards to the real (or dummy) domain and counts what passes through."""

    def __init__(self, inner, counter: RangeCounter) -> None:
        self._inner = inner
        self._counter = counter

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return (message, self._inner.get_event_attributes(message=message, payload=payload))

    def push_range(self, attributes) -> None:
        self._counter._add(attributes[0], step=False)
        self._inner.push_range(attributes[1])

    def pop_range(self) -> None:
        self._inner.pop_range()

    def start_range(self, attributes):
        self._counter._add(attributes[0], step=True)
        return self._inner.start_range(attributes[1])

    def end_range(self, range_id) -> None:
        self._inner.end_range(range_id)


@contextlib.contextmanager
def count_ranges() -> Iterator[RangeCounter]:
    """Enable ranges and count them (works without the ``nvtx`` package); restores the previous state."""
    global _domain, _enabled
    was_enabled = _enabled
    enable_nvtx(True)
    saved = _domain
    counter = RangeCounter()
    _domain = _CountingDomain(saved if saved is not None else _NullDomain(), counter)
    _enabled = True
    try:
        yield counter
    finally:
        _domain = saved
        _enabled = was_enabled and saved is not None


@dataclass(slots=True)
class MarkOverhead:
    """Cost of one ``with mark(...)`` (with a step id and a detail string) in nanoseconds.

    ``baseline_ns`` is the same loop without the range: the added cost of a
    range is ``disabled_ns - baseline_ns`` when off, ``enabled_ns - baseline_ns`` when on.
    """

    baseline_ns: float
    disabled_ns: float
    enabled_ns: float | None  # None: the nvtx package is missing, or a tool is attached (not measured then)
    tool_attached: bool


def measure_mark_overhead(n: int = 200_000) -> MarkOverhead:
    """Time ``n`` empty ranges with NVTX off and on (best of three runs each); restores the state.

    With a tool attached the enabled case is skipped: it would put ``3 n`` ranges into the profile.
    """
    was_enabled = _enabled
    attached = nvtx_tool_attached()

    def run(ranges: bool = True) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter_ns()
            if ranges:
                for i in range(n):
                    with mark("forward", i, " bucket=64"):
                        pass
            else:
                for i in range(n):
                    pass
            best = min(best, (time.perf_counter_ns() - t0) / n)
        return best

    try:
        enable_nvtx(False)
        baseline = run(ranges=False)
        disabled = run()
        enabled = run() if not attached and enable_nvtx(True) else None
    finally:
        enable_nvtx(was_enabled)
    return MarkOverhead(baseline, disabled, enabled, attached)


if os.environ.get("ASYNCBATCH_NVTX") == "1":
    enable_nvtx(True)
