"""``EngineClient``: one engine as every front door sees it (the peer is vLLM's ``vllm/engine/protocol.py``).

    LLM.generate/stream/chat ─┐
    AsyncLLM (serve) ─────────┼─► EngineClient ─► submit(ProcessedRequest...) ─► core process
    EngineReplica (cluster) ──┘        │            abort, stats, health, prefix-cache keys
                                       └─ RequestHandle per request: its stream of deltas and its output

``LLM`` implements it; ``AsyncLLM``, the HTTP server (through ``AsyncLLM``) and the Ray replicas use only
this surface, never an engine's private members. Inputs come from the engine's ``processor``
(``InputProcessor``): ``submit`` takes them as they are and validates nothing again.

Every method is thread-safe and none waits for the device: ``submit`` and ``abort`` are one message to the
engine core; ``stats``, the prefix-cache calls and ``check_integrity`` wait for one reply between two steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from asyncbatch.config import EngineConfig
from asyncbatch.frontend.input_processor import InputProcessor, ProcessedRequest
from asyncbatch.frontend.request_handle import DeltaSink, RequestHandle
from asyncbatch.profiling.timeline import Timeline


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig
    processor: InputProcessor  # the door: tokenizer, limits, validation
    timeline: Timeline  # the steps this frontend has seen
    model_path: Path

    @property
    def alive(self) -> bool:
        """False once the engine failed or was closed (health)."""

    @property
    def num_usable_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def submit(self, requests: Sequence[ProcessedRequest], request_ids: Sequence[str | None] | None = None, *,
               streaming: bool = False, make_sink: Callable[[], DeltaSink] | None = None) -> list[RequestHandle]:
        """Queue every request in one message (a refusal, e.g. a request id in use, queues none); their
        deltas stream into each handle's ``deltas`` (``make_sink()``'s, or a queue) when ``streaming``.
        Raises ``EngineDeadError`` if the engine failed."""

    def abort(self, request_id: str) -> None:
        """End a request with ``finish_reason="abort"`` within a step (unknown or finished ids: nothing)."""

    def abort_all(self) -> int:
        """Abort every unfinished request; returns how many."""

    def num_requests(self) -> tuple[int, int]:
        """(unfinished, not yet scheduled) requests as this process sees them now."""

    def stats(self) -> dict: ...

    def reset_stats(self) -> None: ...

    def prefix_cache_stats(self, timeout: float = 60.0) -> dict: ...

    def prefix_cache_keys(self, max_blocks: int = 4096, timeout: float = 60.0) -> list[int]:
        """Chain keys of up to ``max_blocks`` cached KV blocks: what a cache-aware router matches."""

    def reset_prefix_cache(self) -> bool: ...

    def check_integrity(self) -> None: ...

    def close(self) -> None: ...
