"""The caller's side of a request: its stream of deltas and its final output.

Created at submission; filled only by the output thread (or, on a failure, by
whoever propagates the error). Every caller blocked on a handle wakes up with
either the output or an exception: never a hang.

What the output thread does per token is decided once, here: a handle that is
not streamed, has no stop strings and no logprobs is ``token_only``: each
token is appended to ``token_ids`` (and, with a tokenizer, to ``text_ids``
for one decode at the end, ``DeferredDetokenizer``) and nothing else runs for
it until its last token. ``has_text`` is False without a tokenizer
(``NullDetokenizer``): no detokenizer call at all.

``text_by_caller`` (``LLM.generate``, whose caller reads no text before every
output is in): the output thread does not decode a ``token_only`` request's
text at its end either; it publishes the output without it and sets
``undecoded``, and the caller decodes the whole batch's texts at once
(``detokenizer.decode_deferred``) and puts each in place (``publish_text``).
While the engine still runs other requests, that decode would take CPU from
it; afterwards it runs on every core with the GIL released.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Protocol

from asyncbatch.errors import RequestFailedError
from asyncbatch.frontend.detokenizer import DeferredDetokenizer, IncrementalDetokenizer, NullDetokenizer
from asyncbatch.frontend.stop_strings import StopStringMatcher
from asyncbatch.outputs import Logprobs, RequestMetrics, RequestOutput, StreamDelta


class DeltaSink(Protocol):
    def put(self, item: StreamDelta | BaseException) -> None: ...


@dataclass(eq=False)
class RequestHandle:
    seq: int  # the engine's name for the request (submission order)
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | DeferredDetokenizer | NullDetokenizer
    stops: StopStringMatcher
    metrics: RequestMetrics
    simulated: bool = False
    streaming: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: Logprobs | None = None  # one entry per token_ids entry, when the request asked for logprobs
    prompt_logprobs: Logprobs | None = None  # prompt tokens 1.., when it asked for prompt_logprobs
    prompt_logprobs_streamed: bool = False  # a StreamDelta carried them (the first with tokens)
    num_cached_tokens: int | None = None  # prompt tokens its first admission reused from the prefix cache
    text_pieces: list[str] = field(default_factory=list)  # emitted text, joined once at the end
    output: RequestOutput | None = None
    error: BaseException | None = None
    # Where the output thread puts this request's StreamDeltas (and a failure): a queue for the blocking
    # API, an ``serve.async_stream.AsyncDeltaStream`` for asyncio callers; anything with a thread-safe ``put``.
    deltas: DeltaSink = field(default_factory=queue.SimpleQueue)
    done: threading.Event = field(default_factory=threading.Event)
    text_by_caller: bool = False  # a token_only request's text is decoded by whoever collects it (module doc)
    # include_stop_str_in_output: the text of a stop_token_ids token that ends the request is part of the output
    # (vLLM's rule: its detokenizer leaves out the token that stopped a request only without this flag).
    include_stop_token: bool = False
    min_tokens: int = 0  # stop strings end the output only in the text of later tokens (vLLM's rule)
    parent_id: str | None = None  # one of a stream's n completions: the stream's request id (``LLM.abort`` takes it)
    token_only: bool = field(init=False)  # nothing per token but the id (see the module doc)
    has_text: bool = field(init=False)  # the engine has a tokenizer: outputs carry text
    text_ids: list[int] | None = field(init=False)  # token_only with text: the ids to decode at the end
    undecoded: bool = field(init=False, default=False)  # finished; its text waits for the caller's decode

    def __post_init__(self) -> None:
        self.has_text = not isinstance(self.detokenizer, NullDetokenizer)
        self.token_only = not self.streaming and not self.stops.active and self.logprobs is None
        self.text_ids = None
        if self.token_only and isinstance(self.detokenizer, IncrementalDetokenizer):
            self.detokenizer = DeferredDetokenizer(self.detokenizer)
            self.text_ids = self.detokenizer.ids
        self.text_by_caller = self.text_by_caller and self.text_ids is not None

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    def finish(self, reason: str, stop_reason: int | str | None, now: float, error: str | None = None,
               failure: type[RequestFailedError] = RequestFailedError) -> None:
        """Publish the final output. ``reason == "error"`` (e.g. NaN logits): ``generate`` returns the
        output with ``error`` set, so one failed request does not cost a batch its other outputs;
        ``stream`` raises ``failure`` (``ConstraintConflictError`` where the request's own constraints
        excluded each other)."""
        self.metrics.finished_time = now
        self.output = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.text,
                                    list(self.token_ids), reason, stop_reason, self.metrics, self.simulated, error,
                                    self.logprobs, self.prompt_logprobs,
                                    num_cached_tokens=self.num_cached_tokens)
        if self.streaming:
            if reason == "error":
                self.deltas.put(failure(f"request {self.request_id} failed: {error}"))
            else:
                self.deltas.put(StreamDelta(self.request_id, "", [], reason, stop_reason, self.output))
        self.done.set()

    def publish_text(self, text: str, error: str | None = None) -> None:
        """Put the text the caller decoded (``undecoded``) into the finished output; ``error``: decoding it
        raised, and the output ends in ``"error"`` as the output thread's failures do."""
        self.text_pieces[:] = [text] if text else []
        if self.output is not None:
            self.output.text = text
            if error is not None:
                self.output.finish_reason, self.output.stop_reason, self.output.error = "error", None, error
        self.undecoded = False

    def fail(self, error: BaseException) -> None:
        if self.done.is_set():
            return
        self.error = error
        if self.streaming:
            self.deltas.put(error)
        self.done.set()

    def wait(self, timeout: float | None = None) -> RequestOutput:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output
