"""``ClusterEngine``: the ingress's stand-in for ``AsyncLLM``, whose requests run on the replicas.

The OpenAI routes of ``asyncbatch.serve`` (``completions``, ``chat``, ``generation``) take an engine with
``AsyncLLM``'s surface: ``prompt_ids``, ``submit_ids`` (returning async-iterable requests with ``abort`` and
``final_output``), ``tokenizer``, ``max_model_len``, ``num_requests``, ``alive``, and ``llm`` for the chat
template and the usable context. This class gives them that surface over a Ray Serve deployment handle, so
the routes run unchanged in the ingress: tokenization, the chat template and validation happen here (the
router needs the token ids to compute the prompt's block keys), generation and detokenization on a replica.

Faults. A replica that dies before a choice received any delta is retried on another one (at most
``max_retries`` times; nothing was streamed, so the client sees no difference). One that dies after deltas
were streamed cannot be resumed: the choice fails with ``RequestFailedError`` naming the replica's death,
which the routes turn into a 500 (JSON) or an ``{"error"}`` event and ``[DONE]`` (SSE). No path waits on a
dead replica: Ray fails its calls once the actor is gone.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from ray import exceptions as ray_exceptions
from ray.serve.exceptions import RequestCancelledError

from asyncbatch.cluster.request import ReplicaRequest
from asyncbatch.errors import RequestFailedError
from asyncbatch.llm import LLM
from asyncbatch.outputs import RequestOutput, StreamDelta
from asyncbatch.profiling.timeline import Timeline
from asyncbatch.sampling_params import SamplingParams

log = logging.getLogger("asyncbatch.cluster")

# The replica (its actor or its node) is gone; a request that streamed nothing yet can go elsewhere.
_REPLICA_GONE = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)


class FrontendModel:
    """What the routes read from ``engine.llm``: the tokenizer, the model's limits, and ``LLM``'s own
    validation and chat-template methods (borrowed, not copied: they read only these attributes)."""

    chat_prompt_ids = LLM.chat_prompt_ids
    _prepare_ids = LLM._prepare_ids
    _check_request = LLM._check_request

    def __init__(self, tokenizer, spec, usable_tokens: int) -> None:
        self.tokenizer = tokenizer
        self._spec = spec
        self.model_path: Path = spec.path
        self.max_model_len: int = spec.max_model_len
        self._usable_tokens = usable_tokens
        self.timeline = Timeline()  # the ingress runs no steps; the replicas' timelines hold them


class RemoteRequest:
    """One choice running on a replica: ``AsyncRequest``'s surface (iterate once; leaving early aborts)."""

    def __init__(self, engine: ClusterEngine, request: ReplicaRequest) -> None:
        self._engine = engine
        self._request = request
        self._response = engine.send(request)
        self._output: RequestOutput | None = None
        self._done = False
        self.started = False  # a delta arrived: it left the queues (the router's, the engine's waiting one)
        engine._live.add(self)

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids

    @property
    def output(self) -> RequestOutput | None:
        return self._output

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Cancel the call: Ray cancels the replica's ``generate``, whose iteration aborts the request."""
        self._engine._live.discard(self)
        if not self._done:
            self._done = True
            self._response.cancel()

    async def final_output(self) -> RequestOutput | None:
        return self._output  # a cancelled remote call reports nothing more

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[StreamDelta]:
        retries = 0
        try:
            while True:
                streamed = 0
                try:
                    async for delta in self._response:
                        streamed += 1
                        self.started = True
                        if delta.finish_reason is not None:
                            self._output = delta.output
                            self._done = True
                        yield delta
                        if self._done:
                            return
                    raise RequestFailedError(f"request {self.request_id}: the replica ended its stream without "
                                             "a finish")
                except _REPLICA_GONE as exc:
                    if streamed or retries >= self._engine.max_retries:
                        raise RequestFailedError(
                            f"request {self.request_id}: its replica died after streaming {streamed} deltas "
                            f"({type(exc).__name__}); a started generation cannot be resumed elsewhere") from exc
                    retries += 1
                    log.warning("request %s: replica died before its first token (%s); retry %d on another "
                                "replica", self.request_id, type(exc).__name__, retries)
                    self._response = self._engine.send(self._request)
                except RequestCancelledError:
                    return
        finally:
            self.abort()


class ClusterEngine:
    """``AsyncLLM``'s surface over a Ray Serve handle to ``EngineReplica`` (see the module docstring)."""

    def __init__(self, handle, model: FrontendModel, max_retries: int = 1) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._handle = handle.options(stream=True)
        self.llm = model
        self.max_retries = max_retries
        self._ids = itertools.count()
        self._live: set[RemoteRequest] = set()

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def alive(self) -> bool:
        return True  # Ray replaces dead replicas; a request to none fails by itself

    def send(self, request: ReplicaRequest):
        return self._handle.generate.remote(request)

    async def prompt_ids(self, prompt) -> list[int]:
        return self.llm._prepare_ids(prompt)

    def submit_ids(self, prompt_ids: Sequence[list[int]], params: Sequence[SamplingParams],
                   request_ids: Sequence[str | None], prompts: Sequence | None = None) -> list[RemoteRequest]:
        """Validate every choice here (a refusal sends none), then send each to the replica its router picks."""
        if not len(prompt_ids) == len(params) == len(request_ids):
            raise ValueError("prompts, params and request_ids must have the same length")
        checked = [self.llm._check_request(ids, sp) for ids, sp in zip(prompt_ids, params)]
        texts = prompts if prompts is not None else [None] * len(checked)
        out = []
        for (ids, sp), rid, text in zip(checked, request_ids, texts):
            rid = rid if rid is not None else f"cluster-{next(self._ids)}"
            out.append(RemoteRequest(self, ReplicaRequest(ids, sp, rid, text if isinstance(text, str) else None)))
        return out

    def num_requests(self) -> tuple[int, int]:
        """(requests this ingress sent that are not finished, those of them without a token yet): the second
        is what ``--max-waiting`` bounds, the requests queued in the router or in a replica's waiting queue."""
        live = list(self._live)
        return len(live), sum(not r.started for r in live)
