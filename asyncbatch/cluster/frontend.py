"""``ClusterEngine``: the ingress's ``AsyncEngineClient`` (``serve.engine_protocol``), whose requests run on replicas.

The OpenAI routes of ``asyncbatch.serve`` (``completions``, ``chat``, ``generation``) take an
``AsyncEngineClient``; this class is one over a Ray Serve deployment handle, so the routes run unchanged in
the ingress: tokenization, the chat template and validation happen here, through the same
``InputProcessor`` an engine uses (the router needs the token ids to compute the prompt's block keys), and
once: a replica takes the validated request as it is. Generation and detokenization run on a replica.

Faults. A replica that dies before a choice received any delta is retried on another one (at most
``max_retries`` times; nothing was streamed, so the client sees no difference). One that dies after deltas
were streamed cannot be resumed: the choice fails with ``RequestFailedError`` naming the replica's death,
which the routes turn into a 500 (JSON) or an ``{"error"}`` event and ``[DONE]`` (SSE). No path waits on a
dead replica: Ray fails its calls once the actor is gone.

Shutdown. ``ClusterEngine.abort_all`` (the drain's timeout) cancels every call and ends each choice with a
last delta of ``finish_reason="abort"`` holding what was streamed so far, as an engine's abort does: the
client sees a finished choice and ``[DONE]``, not a cut stream.
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
from asyncbatch.frontend.input_processor import InputProcessor, ProcessedRequest, Prompt
from asyncbatch.outputs import RequestOutput, StreamDelta
from asyncbatch.profiling.timeline import Timeline
from asyncbatch.serve.engine_protocol import AsyncEngineClient
from asyncbatch.serve.request_stream import RequestStream

log = logging.getLogger("asyncbatch.cluster")

# The replica (its actor or its node) is gone; a request that streamed nothing yet can go elsewhere.
_REPLICA_GONE = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)


class FrontendModel:
    """The ingress's side of the model: its ``InputProcessor`` (tokenizer and the engines' limits), and an
    empty timeline (the ingress runs no steps; the replicas' timelines hold them). No weights."""

    def __init__(self, tokenizer, spec, usable_tokens: int, grammar_backend: str = "auto",
                 warm_grammar: bool = False, scheduling_policy: str = "fcfs",
                 sampling_defaults: dict[str, object] | None = None) -> None:
        self.processor = InputProcessor(tokenizer, spec.vocab_size, spec.max_model_len, usable_tokens, spec.eos_token_id,
                                        grammar_backend, scheduling_policy, sampling_defaults)
        if warm_grammar:
            self.processor.warm_up_grammar()
        self.model_path: Path = spec.path
        self.timeline = Timeline()


class RemoteRequest(RequestStream):
    """One choice running on a replica (iterate once; leaving early aborts)."""

    def __init__(self, engine: ClusterEngine, request: ReplicaRequest) -> None:
        super().__init__(request.request_id, request.prompt_token_ids)
        self._engine = engine
        self._request = request
        self._response = engine.send(request)
        self._output: RequestOutput | None = None
        self._done = False
        self._ending = False  # abort_with_finish: the iteration ends with an "abort" delta
        self._text: list[str] = []  # what was streamed, for that delta's output
        self._token_ids: list[int] = []
        self.started = False  # a delta arrived: it left the queues (the router's, the engine's waiting one)
        engine.track(self)

    @property
    def output(self) -> RequestOutput | None:
        return self._output

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Cancel the call: Ray cancels the replica's ``generate``, whose iteration aborts the request."""
        self._engine.untrack(self)
        if not self._done:
            self._done = True
            self._response.cancel()

    def abort_with_finish(self) -> None:
        """Cancel the call, and end the iteration with a ``finish_reason="abort"`` delta (shutdown)."""
        if not self._done and not self._ending:
            self._ending = True
            self._response.cancel()

    async def final_output(self) -> RequestOutput | None:
        return self._output  # a cancelled remote call reports nothing more

    def _abort_delta(self) -> StreamDelta:
        request = self._request
        self._output = RequestOutput(self.request_id, request.prompt_text, request.prompt_token_ids,
                                     "".join(self._text), list(self._token_ids), "abort")
        self._done = True
        return StreamDelta(self.request_id, "", [], "abort", output=self._output)

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        retries = 0
        while True:
            streamed = 0
            try:
                async for delta in self._response:
                    if self._ending:
                        break
                    streamed += 1
                    self.started = True
                    if delta.finish_reason is not None:
                        self._output = delta.output
                        self._done = True
                    self._text.append(delta.text)
                    self._token_ids += delta.token_ids
                    yield delta
                    if self._done:
                        return
                if self._ending:
                    yield self._abort_delta()
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
                if self._ending:
                    yield self._abort_delta()
                return


class ClusterEngine(AsyncEngineClient):
    """An ``AsyncEngineClient`` over a Ray Serve handle to ``EngineReplica`` (see the module docstring)."""

    def __init__(self, handle, model: FrontendModel, max_retries: int = 1) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._handle = handle.options(stream=True)
        self.model = model
        self.max_retries = max_retries
        self._ids = itertools.count()
        self._live: set[RemoteRequest] = set()

    @property
    def processor(self) -> InputProcessor:
        return self.model.processor

    @property
    def model_path(self) -> Path:
        return self.model.model_path

    @property
    def timeline(self) -> Timeline:
        return self.model.timeline

    @property
    def alive(self) -> bool:
        return True  # Ray replaces dead replicas; a request to none fails by itself

    def send(self, request: ReplicaRequest):
        return self._handle.generate.remote(request)

    def track(self, request: RemoteRequest) -> None:
        self._live.add(request)

    def untrack(self, request: RemoteRequest) -> None:
        self._live.discard(request)

    async def prompt_ids(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        return self.processor.prompt_ids(prompt, add_special_tokens)

    def submit_processed(self, requests: Sequence[ProcessedRequest],
                         request_ids: Sequence[str | None]) -> list[RemoteRequest]:
        """Send each validated choice to the replica its router picks."""
        out = []
        for request, rid in zip(requests, request_ids):
            rid = rid if rid is not None else f"cluster-{next(self._ids)}"
            out.append(RemoteRequest(self, ReplicaRequest(request.prompt_token_ids, request.params, rid,
                                                          request.prompt)))
        return out

    def num_requests(self) -> tuple[int, int]:
        """(requests this ingress sent that are not finished, those of them without a token yet): the second
        is what ``--max-waiting`` bounds, the requests queued in the router or in a replica's waiting queue."""
        live = list(self._live)
        return len(live), sum(not r.started for r in live)

    def abort_all(self) -> int:
        """End every unfinished choice with ``finish_reason="abort"`` (see the module docstring)."""
        live = list(self._live)
        for request in live:
            request.abort_with_finish()
        return len(live)

    def prefix_cache_stats(self, timeout: float = 60.0) -> dict | None:
        return None  # each replica reports its own cache (its ``stats``)
