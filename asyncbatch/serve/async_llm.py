"""The asyncio API: ``AsyncLLM``, the same engine as ``LLM`` for event-loop programs (and the HTTP server).

    engine = await AsyncLLM.create(device="cpu")
    async for delta in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(delta.text, end="")

Cancelling the task that consumes ``generate``, or closing the generator early,
aborts the request: the engine frees its KV blocks within a step. Leaving an
``async for`` over ``engine.generate(...)`` early closes it (the loop held its
only reference); a generator kept elsewhere needs ``aclose()``. Nothing here
blocks the event loop: submission is a message to the engine core, long
prompts are tokenized on a worker thread, and the output thread hands deltas
over in batches (``async_stream``), so the loop does no per-token work beyond
taking them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from asyncbatch.frontend.engine_client import EngineClient
from asyncbatch.frontend.input_processor import InputProcessor, ProcessedRequest, Prompt, unpack_prompt
from asyncbatch.frontend.request_handle import RequestHandle
from asyncbatch.llm import LLM
from asyncbatch.outputs import RequestOutput, StreamDelta
from asyncbatch.profiling.timeline import Timeline
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.serve.async_stream import AsyncDeltaStream, LoopWaker, merge_deltas
from asyncbatch.serve.engine_protocol import AsyncEngineClient
from asyncbatch.serve.request_stream import RequestStream, interleave

# Text prompts longer than this are tokenized on a worker thread (a few ms of tokenizer work would stall
# every stream on the loop); shorter ones cost less than the thread hop.
_OFFLOAD_CHARS = 4096


class AsyncRequest(RequestStream):
    """One submitted request of this process's engine: iterate it for its deltas (once); leaving early aborts it."""

    def __init__(self, client: EngineClient, handle: RequestHandle, stream: AsyncDeltaStream) -> None:
        super().__init__(handle.request_id, handle.prompt_token_ids)
        self._client = client
        self._handle = handle
        self._stream = stream

    @property
    def output(self) -> RequestOutput | None:
        return self._handle.output

    @property
    def finished(self) -> bool:
        return self._handle.finished

    def abort(self) -> None:
        if not self._handle.finished:
            self._client.abort(self._handle.request_id)

    async def final_output(self) -> RequestOutput | None:
        """Reads what the iteration left in the stream."""
        while not self._handle.finished or self._stream.items:
            for item in await self._stream.next_batch():
                if isinstance(item, BaseException):
                    return None
                if item.finish_reason is not None:
                    return self._handle.output
        return self._handle.output

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        while True:
            batch = await self._stream.next_batch()
            deltas: list[StreamDelta] = []
            for item in batch:
                if isinstance(item, BaseException):
                    if deltas:
                        yield merge_deltas(deltas)
                    raise item
                deltas.append(item)
            delta = merge_deltas(deltas)
            yield delta
            if delta.finish_reason is not None:
                return


class AsyncLLM(AsyncEngineClient):
    """An inference engine for asyncio programs; see ``LLM`` for the keywords (``AsyncLLM(model, **kwargs)``).

    Build it with ``await AsyncLLM.create(...)`` inside a running loop (loading takes seconds, on a
    worker thread), or ``AsyncLLM(...)`` outside one. Methods must be called from one event loop.
    It is an ``AsyncEngineClient`` (``serve.engine_protocol``) over ``llm``, an ``EngineClient``.
    """

    def __init__(self, model: str | None = None, *, llm: LLM | None = None, **kwargs: object) -> None:
        self.llm: LLM = llm if llm is not None else LLM(model, **kwargs)
        self._waker: LoopWaker | None = None

    @classmethod
    async def create(cls, model: str | None = None, **kwargs: object) -> AsyncLLM:
        return await asyncio.to_thread(cls, model, **kwargs)

    # -- what the engine serves ------------------------------------------------
    @property
    def processor(self) -> InputProcessor:
        return self.llm.processor

    @property
    def model_path(self) -> Path:
        return self.llm.model_path

    @property
    def timeline(self) -> Timeline:
        return self.llm.timeline

    @property
    def alive(self) -> bool:
        return self.llm.alive

    # -- requests --------------------------------------------------------------
    def _sink_factory(self):
        loop = asyncio.get_running_loop()
        if self._waker is None or not self._waker.serves(loop):
            self._waker = LoopWaker(loop)
        waker = self._waker
        return lambda: AsyncDeltaStream(waker)

    async def prompt_ids(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, validated (long texts are tokenized off the loop)."""
        if isinstance(prompt, str) and len(prompt) > _OFFLOAD_CHARS:
            return await asyncio.to_thread(self.processor.prompt_ids, prompt, add_special_tokens)
        return self.processor.prompt_ids(prompt, add_special_tokens)

    async def submit(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams | None],
                     request_ids: Sequence[str | None]) -> list[AsyncRequest]:
        """Validate every prompt, then submit them all in one message (a refusal submits none).

        Raises ``ValueError``/``TypeError`` naming the field for bad input, ``EngineDeadError`` if the
        engine failed.
        """
        if len(prompts) != len(params):
            raise ValueError("prompts, params and request_ids must have the same length")
        unpacked = [unpack_prompt(p, sp if sp is not None else self.processor.default_params())  # vLLM's prompt dicts
                    for p, sp in zip(prompts, params)]
        prompts, params = [p for p, _ in unpacked], [sp for _, sp in unpacked]
        return self.submit_ids([await self.prompt_ids(p) for p in prompts], params, request_ids, prompts)

    def submit_processed(self, requests: Sequence[ProcessedRequest],
                         request_ids: Sequence[str | None]) -> list[AsyncRequest]:
        """Submit requests validated elsewhere (a replica's, by the ingress) as they are."""
        handles = self.llm.submit(requests, list(request_ids), streaming=True, make_sink=self._sink_factory())
        return [AsyncRequest(self.llm, h, h.deltas) for h in handles]

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Stream one request's deltas; the last has ``finish_reason`` and the whole ``output``. With
        ``n > 1`` the completions' deltas interleave, each with its ``index``, until every one has finished
        (``StreamDelta``); ``abort(request_id)`` stops them all."""
        prompt, params = unpack_prompt(prompt, sampling_params if sampling_params is not None
                                       else self.processor.default_params())
        if params.n == 1:
            (request,) = await self.submit([prompt], [params], [request_id])
            async for delta in request:
                yield delta
            return
        processed = self.processor.request(await self.prompt_ids(prompt), params,
                                           prompt if isinstance(prompt, str) else None)
        parent, handles = self.llm.submit_stream(processed, request_id, self._sink_factory())
        streams = [AsyncRequest(self.llm, handle, handle.deltas) for handle in handles]
        async with contextlib.aclosing(interleave(streams)) as merged:  # leaving early aborts every completion
            async for index, delta in merged:
                delta.request_id, delta.index = parent, index
                yield delta

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with ``finish_reason="abort"`` within a step."""
        self.llm.abort(request_id)

    def abort_all(self) -> int:
        return self.llm.abort_all()

    # -- measurement and lifetime ------------------------------------------------
    async def stats(self) -> dict:
        return await asyncio.to_thread(self.llm.stats)

    def prefix_cache_stats(self, timeout: float = 60.0) -> dict | None:
        """The engine core's prefix-cache counters (blocks until the core answers: call off the loop)."""
        return self.llm.prefix_cache_stats(timeout=timeout)

    async def check_integrity(self) -> None:
        await asyncio.to_thread(self.llm.check_integrity)

    def num_requests(self) -> tuple[int, int]:
        """(unfinished, not yet scheduled) requests, as this process sees them now."""
        return self.llm.num_requests()

    def close(self) -> None:
        self.llm.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.llm.close)

    async def __aenter__(self) -> AsyncLLM:  # noqa: PYI034 - not meant to be subclassed
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
