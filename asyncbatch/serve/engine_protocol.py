"""``AsyncEngineClient``: what the OpenAI routes serve from, ``AsyncLLM`` here or the cluster's ``ClusterEngine``.

The asyncio face of ``frontend.engine_client.EngineClient``: ``AsyncLLM`` implements it over an in-process
``EngineClient``, ``ClusterEngine`` over a Ray Serve handle to the replicas (each of which runs an
``AsyncLLM``); both subclass it for the members it derives (``tokenizer``, ``max_model_len``, ``submit_ids``).
Requests come back as ``RequestStream``s. Validation happens once, in ``prompt_ids`` (per prompt) and
``submit_ids`` (per request) through ``processor``; ``submit_processed`` takes requests another door already
validated (a replica's, from the ingress) and checks nothing again.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from asyncbatch.frontend.input_processor import InputProcessor, ProcessedRequest, Prompt
from asyncbatch.profiling.timeline import Timeline
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.serve.request_stream import RequestStream


@runtime_checkable
class AsyncEngineClient(Protocol):
    """An engine for the asyncio routes. Methods are called from the event loop and never block it, except
    ``prefix_cache_stats``, which waits for the engine core's answer (call it off the loop)."""

    @property
    def processor(self) -> InputProcessor: ...

    @property
    def tokenizer(self):
        """The processor's tokenizer (None with ``skip_tokenizer_init``)."""
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    @property
    def model_path(self) -> Path: ...

    @property
    def timeline(self) -> Timeline:
        """Steps for ``/metrics`` (empty in the ingress: the replicas run them)."""

    @property
    def alive(self) -> bool: ...

    async def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated against the vocabulary (long texts are tokenized off the loop)."""

    def submit_ids(self, prompt_ids: Sequence[list[int]], params: Sequence[SamplingParams],
                   request_ids: Sequence[str | None], prompts: Sequence[Prompt] | None = None
                   ) -> list[RequestStream]:
        """``submit`` for prompts already turned into validated token ids (``prompt_ids``), so they are not
        tokenized and checked a second time: validate every request (a refusal submits none), then submit
        them all. ``prompts`` (text) only name them in the outputs."""
        if not len(prompt_ids) == len(params) == len(request_ids):
            raise ValueError("prompts, params and request_ids must have the same length")
        texts = prompts if prompts is not None else [None] * len(prompt_ids)
        requests = [self.processor.request(ids, sp, text if isinstance(text, str) else None)
                    for ids, sp, text in zip(prompt_ids, params, texts)]
        return self.submit_processed(requests, request_ids)

    def submit_processed(self, requests: Sequence[ProcessedRequest], request_ids: Sequence[str | None]
                         ) -> list[RequestStream]: ...

    def num_requests(self) -> tuple[int, int]:
        """(unfinished, not yet started) requests: what ``--max-waiting`` bounds."""

    def abort_all(self) -> int:
        """Abort every unfinished request; returns how many."""

    def prefix_cache_stats(self, timeout: float = 60.0) -> dict | None:
        """The engine's prefix-cache counters, or None where there is no one engine (the ingress)."""
