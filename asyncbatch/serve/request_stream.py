"""``RequestStream``: one submitted request as an asyncio caller holds it, wherever the engine runs.

``AsyncRequest`` (this process's engine) and the cluster's ``RemoteRequest`` (a Ray replica's) are the two
kinds; the routes (``serve.generation``) only see this surface. Invariants, kept here once for both:

* iterate it once: its deltas in order, the last with ``finish_reason`` and the whole ``output``;
* leaving the iteration early, cancelling the task that iterates, or a failure aborts the request
  (``abort`` is idempotent and never raises), so the engine frees its KV blocks within a step.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

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
