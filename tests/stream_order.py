"""A happens-before checker for the CUDA executor's stream protocol, run on the CPU.

On the CPU shim every "stream" runs its work at once, in program order, so a
missing event wait changes nothing there; on a GPU it is a race that shows up
once in a thousand steps. This checker does not run anything differently: it
replaces ``torch.cuda.Stream``/``Event``/``stream``/``synchronize`` with
versions that keep a vector clock per timeline (the planner thread, each
stream), and logs every access to the buffers two timelines share:

    host timeline   writer.write(staging) ● pad rows ● ........ wait(N): read pinned out ●
                          │ (issue)                                  ▲ event.synchronize
    H2D stream            └► read staging / write static inputs ●h2d_end│
    compute stream                  (wait ●) read static inputs, write static outputs ●end
    D2H stream                                     (wait ●) read outputs, write pinned out ●d2h

An op issued to a stream happens after everything its issuing thread did
before; ``record``/``wait_event``/``wait_stream``/``synchronize`` carry clocks
between timelines as CUDA orders them. Two accesses to overlapping bytes of a
watched buffer, one of them a write, on different timelines, must be ordered
one way or the other; ``races()`` lists the pairs that are not.

Which timeline an access belongs to follows what it would be on a GPU:
non-blocking copies, ``fill_`` of device buffers, graph replays and uploads
(``.to(device, non_blocking=True)``) run on the current stream; ``__setitem__``
on pinned host buffers, the metadata writer and the padding of host rows run
on the host. Only buffers registered with ``watch`` are tracked: fresh
allocations are the caching allocator's business, which this does not model.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

Clock = dict[str, int]


def _join(into: Clock, other: Clock) -> None:
    for key, value in other.items():
        if into.get(key, 0) < value:
            into[key] = value


@dataclass(slots=True)
class Access:
    buffer: str
    lo: int
    hi: int
    write: bool
    timeline: str
    clock: Clock
    what: str

    def before(self, other: Access) -> bool:
        return self.clock[self.timeline] <= other.clock.get(self.timeline, 0)


@dataclass
class StreamOrderChecker:
    enabled: bool = False
    clocks: dict[str, Clock] = field(default_factory=dict)
    accesses: list[Access] = field(default_factory=list)
    _watched: list[tuple[int, int, str, bool]] = field(default_factory=list)  # lo, hi, name, on the host
    _local: threading.local = field(default_factory=threading.local)
    _ids: itertools.count = field(default_factory=itertools.count)

    # -- timelines -----------------------------------------------------------------
    def _clock(self, timeline: str) -> Clock:
        return self.clocks.setdefault(timeline, {timeline: 0})

    def host_timeline(self) -> str:
        return f"host:{threading.current_thread().name}"

    def current_stream(self) -> _Stream:
        stack = getattr(self._local, "streams", None)
        return stack[-1] if stack else self.default_stream

    def tick(self, timeline: str) -> Clock:
        """One operation on ``timeline``; a stream's operation is issued by this thread, so comes after it."""
        clock = self._clock(timeline)
        if not timeline.startswith("host:"):
            _join(clock, self._clock(self.host_timeline()))
        clock[timeline] += 1
        return dict(clock)

    # -- accesses -------------------------------------------------------------------
    def watch(self, name: str, buffer: torch.Tensor | np.ndarray, on_host: bool) -> None:
        lo, hi = _span(buffer)
        self._watched.append((lo, hi, name, on_host))

    def is_host_buffer(self, buffer: torch.Tensor | np.ndarray) -> bool | None:
        """True / False for a watched host / device buffer, None for an unwatched one."""
        lo, hi = _span(buffer)
        for w_lo, w_hi, _, on_host in self._watched:
            if lo < w_hi and w_lo < hi:
                return on_host
        return None

    def access(self, buffer: torch.Tensor | np.ndarray, write: bool, timeline: str, what: str,
               clock: Clock | None = None) -> None:
        if not self.enabled:
            return
        lo, hi = _span(buffer)
        for w_lo, w_hi, name, _ in self._watched:
            if lo < w_hi and w_lo < hi:
                self.accesses.append(Access(name, max(lo, w_lo), min(hi, w_hi), write, timeline,
                                            clock or self.tick(timeline), what))

    def conflicts(self) -> list[tuple[Access, Access]]:
        """Pairs of accesses to overlapping bytes, at least one a write, on different timelines."""
        by_buffer: dict[str, list[Access]] = {}
        for a in self.accesses:
            by_buffer.setdefault(a.buffer, []).append(a)
        return [(a, b) for group in by_buffer.values() for i, a in enumerate(group) for b in group[i + 1:]
                if a.timeline != b.timeline and (a.write or b.write) and a.lo < b.hi and b.lo < a.hi]

    def races(self) -> list[tuple[Access, Access]]:
        """The conflicting pairs that nothing orders: neither happens before the other."""
        return [(a, b) for a, b in self.conflicts() if not a.before(b) and not b.before(a)]

    # -- the fake CUDA API ------------------------------------------------------------------
    def install(self, monkeypatch) -> None:
        checker = self
        self.default_stream = _Stream(self, "default")

        @contextlib.contextmanager
        def stream_context(stream):
            stack = checker._local.__dict__.setdefault("streams", [])
            stack.append(stream)
            try:
                yield
            finally:
                stack.pop()

        def synchronize(device=None) -> None:
            host = checker._clock(checker.host_timeline())
            for timeline, clock in checker.clocks.items():
                if not timeline.startswith("host:"):
                    _join(host, clock)

        class Stream(_Stream):  # classes, not factories: annotations like `torch.cuda.Stream | None` still work
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(checker)

        class Event(_Event):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(checker)

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream_context)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: checker.current_stream())
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        self._patch_tensor(monkeypatch)

    def _patch_tensor(self, monkeypatch) -> None:
        checker = self
        copy_, to, fill_, setitem = torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.fill_, torch.Tensor.__setitem__

        def logged_copy(dst, src, non_blocking=False):
            if checker.enabled and isinstance(src, torch.Tensor):
                device_side = non_blocking or checker.is_host_buffer(dst) is False
                timeline = checker.current_stream().timeline if device_side else checker.host_timeline()
                clock = checker.tick(timeline)
                checker.access(src, False, timeline, "copy_ source", clock)
                checker.access(dst, True, timeline, "copy_ destination", clock)
            return copy_(dst, src, non_blocking=non_blocking)

        def logged_to(tensor, *args, **kwargs):
            if checker.enabled and kwargs.get("non_blocking"):  # an upload: an async copy on the current stream
                timeline = checker.current_stream().timeline
                checker.access(tensor, False, timeline, "upload (.to non_blocking)")
                return copy_(torch.empty_like(tensor), tensor)
            return to(tensor, *args, **kwargs)

        def logged_fill(tensor, value):
            if checker.enabled and checker.is_host_buffer(tensor) is False:
                checker.access(tensor, True, checker.current_stream().timeline, "fill_")
            return fill_(tensor, value)

        def logged_setitem(tensor, index, value):
            if checker.enabled and checker.is_host_buffer(tensor):
                checker.access(tensor, True, checker.host_timeline(), "host __setitem__")
            return setitem(tensor, index, value)

        monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
        monkeypatch.setattr(torch.Tensor, "to", logged_to)
        monkeypatch.setattr(torch.Tensor, "fill_", logged_fill)
        monkeypatch.setattr(torch.Tensor, "__setitem__", logged_setitem)

    # -- the engine's shared buffers and host-side accesses -------------------------------------
    def watch_engine(self, core, monkeypatch) -> None:
        """Register the engine's shared buffers and log the host's and the graphs' accesses to them."""
        checker = self
        executor = core.executor
        for staging in core.staging.buffers:
            for name, array in _staging_arrays(staging):
                self.watch(f"staging{staging.index}.{name}", array, on_host=True)
        for name in ("_out_host", "_finite_host"):
            for i, buffer in enumerate(getattr(executor, name)):
                self.watch(f"{name}[{i}]", buffer, on_host=True)
        self.watch("token_buffer", executor.token_buffer, on_host=False)
        if executor.graphs is not None:
            for s, buffers in enumerate(executor.graphs.sets):
                for name, tensor in {**buffers.tensors, **buffers.outputs}.items():
                    self.watch(f"set{s}.{name}", tensor, on_host=False)
                self.watch(f"set{s}.host_block", buffers.host_block, on_host=True)

        write, wait = core.writer.write, executor.wait

        def logged_write(plan, staging):
            for _, array in _staging_arrays(staging):
                checker.access(array, True, checker.host_timeline(), f"metadata writer, staging {staging.index}")
            return write(plan, staging)

        def logged_wait(handle):
            result = wait(handle)
            for name in ("_out_host", "_finite_host"):
                checker.access(getattr(executor, name)[handle.step_id % 2], False, checker.host_timeline(),
                               f"wait({handle.step_id}) reads {name}")
            return result

        monkeypatch.setattr(core.writer, "write", logged_write)
        monkeypatch.setattr(executor, "wait", logged_wait)
        if executor.graphs is not None:
            runner_type = type(executor.graphs)  # slotted: patched on the class
            replay, pack = runner_type.replay, runner_type.pack

            def logged_replay(runner, set_index, bucket, variant):
                timeline = checker.current_stream().timeline
                for tensor in runner.sets[set_index].views(bucket).values():
                    checker.access(tensor, False, timeline, f"replay set {set_index} bucket {bucket}")
                return replay(runner, set_index, bucket, variant)

            def logged_pack(runner, set_index, host, rows, bucket):
                for spec in runner.sets[set_index].specs if rows < bucket else ():  # padding: written on the host
                    checker.access(host[spec.host][rows:bucket], True, checker.host_timeline(), "pad host rows")
                for spec in runner.sets[set_index].specs:  # packing reads the host arrays, on the host
                    checker.access(host[spec.host][:bucket], False, checker.host_timeline(), "pack host rows")
                checker.access(runner.sets[set_index].host_block, True, checker.host_timeline(),
                               f"pack set {set_index}'s host block")
                return pack(runner, set_index, host, rows, bucket)

            monkeypatch.setattr(runner_type, "replay", logged_replay)
            monkeypatch.setattr(runner_type, "pack", logged_pack)


class _Stream:
    def __init__(self, checker: StreamOrderChecker, name: str | None = None) -> None:
        self.checker = checker
        self.timeline = f"stream:{name or next(checker._ids)}"
        checker._clock(self.timeline)

    def wait_event(self, event: _Event) -> None:
        clock = self.checker._clock(self.timeline)
        _join(clock, self.checker._clock(self.checker.host_timeline()))
        _join(clock, event.clock)

    def wait_stream(self, stream: _Stream) -> None:
        _join(self.checker._clock(self.timeline), self.checker._clock(stream.timeline))

    def synchronize(self) -> None:
        _join(self.checker._clock(self.checker.host_timeline()), self.checker._clock(self.timeline))


class _Event:
    """Recorded on the current stream: carries its clock; ``synchronize`` brings it to the host."""

    def __init__(self, checker: StreamOrderChecker) -> None:
        self.checker = checker
        self.clock: Clock = {}
        self.time: float | None = None

    def record(self, stream: _Stream | None = None) -> None:
        stream = stream or self.checker.current_stream()
        self.clock = self.checker.tick(stream.timeline)
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        assert self.time is not None, "waited on an event that was never recorded"
        _join(self.checker._clock(self.checker.host_timeline()), self.clock)

    def query(self) -> bool:
        return self.time is not None

    def elapsed_time(self, other: _Event) -> float:
        return (other.time - self.time) * 1e3


def _span(buffer: torch.Tensor | np.ndarray) -> tuple[int, int]:
    if isinstance(buffer, np.ndarray):
        lo = buffer.__array_interface__["data"][0]
        return lo, lo + max(buffer.nbytes, 1)
    lo = buffer.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(buffer.shape, buffer.stride()) if size) + 1
    return lo, lo + max(extent * buffer.element_size(), 1)


def _staging_arrays(staging) -> list[tuple[str, np.ndarray]]:
    return [(name, getattr(staging, name)) for name in staging.__dataclass_fields__
            if isinstance(getattr(staging, name), np.ndarray)]
