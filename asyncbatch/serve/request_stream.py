"""``RequestStream``: one submitted request as an asyncio caller holds it, wherever the engine runs.

``AsyncRequest`` (this process's engine) and the cluster's ``RemoteRequest`` (a Ray replica's) are the two
kinds; the routes (``serve.generation``) only see this surface. Invariants, kept here once for both:

* iterate it once: its deltas in order, the last with ``finish_reason`` and the whole ``output``;
* leaving the iteration early, cancelling the task that iterates, or a failure aborts the request
  (``abort`` is idempotent and never raises), so the engine frees its KV blocks within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence

from asyncbatch.outputs import RequestOutput, StreamDelta


class RequestStream(ABC):
    """An async-iterable request: ``async for delta in request``; see the module docstring."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids

    @property
    @abstractmethod
    def output(self) -> RequestOutput | None:
        """The final output, once the last delta was taken."""

    @property
    @abstractmethod
    def finished(self) -> bool: ...

    @abstractmethod
    def abort(self) -> None:
        """Stop the request (nothing if it finished); idempotent."""

    @abstractmethod
    async def final_output(self) -> RequestOutput | None:
        """After the iteration was left early (and the request aborted): the output it ended with, if the
        engine still reports one; None if it failed or cannot tell."""

    @abstractmethod
    def deltas(self) -> AsyncIterator[StreamDelta]:
        """The request's deltas up to and including the finishing one (an async generator)."""

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamDelta]:
        try:
            async with contextlib.aclosing(self.deltas()) as deltas:
                async for delta in deltas:
                    yield delta
        finally:  # cancelled, closed early, or failed: the engine stops working on it
            self.abort()


async def interleave(requests: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(index in ``requests``, delta) as the requests' deltas arrive, until every one has finished. A failure
    of one is raised here; leaving early, or a failure, cancels the pumps, and a cancelled pump closes its
    request's iteration, which aborts it."""
    if len(requests) == 1:
        async with contextlib.aclosing(aiter(requests[0])) as deltas:
            async for delta in deltas:
                yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, request: RequestStream) -> None:
        try:
            async for delta in request:
                queue.put_nowait((index, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield index, item
            if item.finish_reason is not None:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
