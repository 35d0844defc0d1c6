"""What callers get back: final outputs, streamed deltas and per-request metrics."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first output token reaching the caller."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities of a run of tokens, columnar: entry ``i`` is about ``token_ids[i]``.

    ``logprobs[i]`` is the token's log-probability under the model's raw
    distribution at its position, ``ranks[i]`` its rank there (1 = most likely),
    ``top_token_ids[i]`` / ``top_logprobs[i]`` the ``k`` most likely tokens,
    most likely first (``k`` is what the request asked for; 0 gives empty lists).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: Logprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_token_ids += other.top_token_ids
        self.top_logprobs += other.top_logprobs

    def slice(self, start: int, stop: int | None = None) -> Logprobs:
        s = slice(start, stop)
        return Logprobs(self.token_ids[s], self.logprobs[s], self.ranks[s], self.top_token_ids[s],
                        self.top_logprobs[s])

    def as_dicts(self) -> list[dict[int, float]]:
        """vLLM's per-position form: ``{token_id: logprob}`` holding the chosen token and the top ``k``."""
        out = []
        for token, lp, ids, lps in zip(self.token_ids, self.logprobs, self.top_token_ids, self.top_logprobs):
            entry = dict(zip(ids, lps))
            entry[token] = lp
            out.append(entry)
        return out


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request, vLLM's ``CompletionOutput``: ``RequestOutput.outputs[index]``.

    ``cumulative_logprob`` is the sum of ``logprobs.logprobs`` where the request asked for logprobs, else None
    (vLLM's rule). ``logprobs`` is the columnar ``Logprobs``; ``logprobs.as_dicts()`` gives vLLM's per-position
    ``{token_id: logprob}`` form. ``error`` (not vLLM's) says why a completion ended in ``"error"``.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Logprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The finished request: vLLM's ``RequestOutput``, its first completion flattened into it.

    ``text``, ``token_ids``, ``finish_reason``, ``stop_reason``, ``error`` and ``logprobs`` are the first
    completion's, so a program that asks for one completion reads them directly; ``outputs`` is vLLM's list,
    ``SamplingParams.n`` entries in index order (``LLM.generate`` / ``LLM.chat`` with ``n > 1`` put the others in
    ``more_outputs``). ``metrics`` covers every completion: the first arrival, the last finish.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    simulated: bool = False
    error: str | None = None
    # Asked for with SamplingParams.logprobs / prompt_logprobs; prompt_logprobs covers prompt tokens 1..P-1
    # (the first token has no context to be scored in).
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    more_outputs: list[CompletionOutput] = field(default_factory=list)  # completions 1 .. n - 1
    # vLLM's: prompt tokens whose KV came from the prefix cache at the request's first admission (0: none; None:
    # never admitted, e.g. aborted while waiting). With ``n > 1``, the first completion's.
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's ``outputs``: the first completion, built from this object's own fields as they stand now (a
        snapshot: assigning to it changes nothing here), then ``more_outputs``."""
        cumulative = math.fsum(self.logprobs.logprobs) if self.logprobs is not None else None
        first = CompletionOutput(0, self.text, self.token_ids, cumulative, self.logprobs, self.finish_reason,
                                 self.stop_reason, self.error)
        return [first, *self.more_outputs]


def merge_completions(outputs: list[RequestOutput]) -> RequestOutput:
    """One ``RequestOutput`` of the finished requests ``outputs``, the ``n`` completions of one prompt in index
    order: the first keeps its fields and its request id, the others become its ``more_outputs``, and its metrics
    span them all (the first arrival and first token, the last finish, every preemption)."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    first.more_outputs = [_indexed(output.outputs[0], index) for index, output in enumerate(outputs[1:], 1)]
    metrics = [output.metrics for output in outputs if output.metrics is not None]
    if metrics:
        first.metrics = RequestMetrics(
            arrival_time=min(m.arrival_time for m in metrics),
            first_scheduled_time=_earliest(m.first_scheduled_time for m in metrics),
            first_token_time=_earliest(m.first_token_time for m in metrics),
            finished_time=None if any(m.finished_time is None for m in metrics) else max(m.finished_time
                                                                                          for m in metrics),
            num_preemptions=sum(m.num_preemptions for m in metrics))
    return first


def _indexed(completion: CompletionOutput, index: int) -> CompletionOutput:
    completion.index = index
    return completion


def _earliest(times: Iterable[float | None]) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


@dataclass(slots=True)
class StreamDelta:
    """New text and tokens since the previous delta of the same completion; the last one (``finish_reason``
    set) carries the whole ``RequestOutput`` as ``output`` (its metrics and token counts).

    A stream of ``SamplingParams.n > 1`` completions interleaves theirs: ``index`` says whose (vLLM's
    ``CompletionOutput.index``), each ends with its own finishing delta, and ``request_id`` is the stream's
    (its completions run as requests ``<request_id>-<index>``, the names their ``output`` carries)."""

    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output: RequestOutput | None = None
    logprobs: Logprobs | None = None  # of this delta's token_ids, when the request asked for logprobs
    index: int = 0  # which of the stream's n completions
    # The prompt's logprobs (tokens 1..), on the completion's first delta with tokens, when it asked for them:
    # the prefill that scored them ends in the step that samples the first token.
    prompt_logprobs: Logprobs | None = None
