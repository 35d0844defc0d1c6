"""Handing a request's deltas from the output thread to an asyncio task, one wake-up per batch of deltas.

The output thread puts every delta of a step; the event loop must not pay a
cross-thread call per token. So a ``LoopWaker`` coalesces: the first ``put``
after the loop last woke schedules one callback (``call_soon_threadsafe``),
later puts only append; the callback sets the event of every stream that got
something, and each consumer drains its whole deque at once (merging the
deltas, so a consumer that fell behind sends one chunk, not many).

    output thread   put(a1) put(b1) put(c1) ........ put(a2) put(b2) ...
                      └─ schedule wake                  └─ schedule wake
    event loop      ........... [wake: set a, b, c] [task a: drain a1] [task b: drain b1] ...

A stream is consumed by one task. A delta put after its final delta (or after
a failure) is never produced by the output thread: the handle finishes once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from asyncbatch.outputs import Logprobs, StreamDelta


class LoopWaker:
    """Wakes the streams that got deltas, with one ``call_soon_threadsafe`` per burst of puts."""

    __slots__ = ("_armed", "_lock", "_loop", "_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[AsyncDeltaStream] = []
        self._armed = False

    def serves(self, loop: asyncio.AbstractEventLoop) -> bool:
        """True if this waker wakes streams on ``loop``."""
        return self._loop is loop

    def notify(self, stream: AsyncDeltaStream) -> None:
        """Any thread: ``stream`` has something; wake its consumer soon."""
        with self._lock:
            self._pending.append(stream)
            if self._armed:
                return
            self._armed = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody is left to read the stream
            with self._lock:
                self._armed = False
                self._pending.clear()

    def _wake(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._armed = False
        for stream in pending:
            stream.event.set()


class AsyncDeltaStream:
    """One request's deltas for an asyncio consumer: the handle's ``deltas`` sink (``put`` from any thread)."""

    __slots__ = ("event", "items", "waker")

    def __init__(self, waker: LoopWaker) -> None:
        self.items: deque[StreamDelta | BaseException] = deque()
        self.event = asyncio.Event()
        self.waker = waker

    def put(self, item: StreamDelta | BaseException) -> None:
        self.items.append(item)
        self.waker.notify(self)

    async def next_batch(self) -> list[StreamDelta | BaseException]:
        """Everything put since the last call (at least one item), in order."""
        while not self.items:
            await self.event.wait()
            self.event.clear()
        batch = []
        items = self.items
        while items:  # popleft, not a copy and clear: the output thread may append meanwhile
            batch.append(items.popleft())
        return batch


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """Consecutive deltas of one request as one (text and token ids concatenated, the last one's finish)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    token_ids = [t for d in deltas for t in d.token_ids]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = Logprobs()
        for d in deltas:
            if d.logprobs is not None:
                logprobs.extend(d.logprobs)
    prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return StreamDelta(last.request_id, "".join(d.text for d in deltas), token_ids, last.finish_reason,
                       last.stop_reason, last.output, logprobs, last.index, prompt)
