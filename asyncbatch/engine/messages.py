"""What the frontend and the engine core say to each other: typed, columnar, picklable.

    frontend (caller's process)                        engine core (planner thread)
      AddRequests ─────────────────────────────────────►  queue, schedule
      AbortRequests / FinishRequests (stop strings) ────►  finish, free blocks
      StepAck (synchronous mode only) ─────────────────►  plan the next step
      Call (``engine.control``: one type per call) ────►  answered between two steps
      Shutdown ────────────────────────────────────────►  stop
      ◄──────────────────────────────────────────────── CoreReady (once)
      ◄──────────────────────────────────────────────── StepOutputs (one per applied step)
      ◄──────────────────────────────────────────────── Reply (one per Call: a value or an exception)
      ◄──────────────────────────────────────────────── CoreFailed (then nothing)

A request is named by its ``seq`` (the frontend's submission counter) on both
sides. ``StepOutputs`` is columnar: a handful of numpy arrays per step, never
one object per request; on the pipe it travels as one flat buffer
(``step_wire``), every other message as a pickle.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from asyncbatch.profiling.timeline import StepRecord
from asyncbatch.sampling_params import SamplingParams


class Finish(enum.IntEnum):
    """Why a request ended (``NONE``: it goes on). Stored as int8 in ``StepOutputs``."""

    NONE = 0
    EOS = 1  # the model's end-of-sequence token (kept in token_ids, never detokenized)
    STOP_TOKEN = 2  # one of the request's stop_token_ids
    LENGTH = 3  # max_tokens reached
    ABORT = 4
    ERROR = 5  # non-finite logits, or the frontend failed to process the request
    STOP_STRING = 6  # found by the frontend; the core only frees the request
    REFUSED = 7  # the scheduler could never place it (built past the input processor), or queuing it failed
    GRAMMAR = 8  # its grammar failed to compile in the core, or rejected a sampled token (no token kept)
    CONSTRAINED = 9  # its token masks (grammar, allowed_token_ids, bad_words) together allowed no token

    @property
    def reason(self) -> str:
        """The ``finish_reason`` a caller sees."""
        return _REASONS[self]


_REASONS = {Finish.NONE: "", Finish.EOS: "stop", Finish.STOP_TOKEN: "stop", Finish.LENGTH: "length",
            Finish.ABORT: "abort", Finish.ERROR: "error", Finish.STOP_STRING: "stop", Finish.REFUSED: "error",
            Finish.GRAMMAR: "error", Finish.CONSTRAINED: "error"}

NON_FINITE_MESSAGE = "the model produced NaN or infinite logits for this request"
GRAMMAR_MESSAGE = ("structured output failed in the engine core: the grammar did not compile there, or it, "
                   "allowed_token_ids or bad_words rejected a sampled token (a bug: the token mask should have "
                   "prevented it)")
CONSTRAINED_MESSAGE = ("the request's token constraints exclude each other: its structured output, allowed_token_ids "
                       "and bad_words together left no token to sample")
REFUSED_MESSAGE = ("the engine core refused this request: its prompt + max_tokens exceed what one request can "
                   "hold (max_model_len, or the whole KV cache; the input processor refuses such requests "
                   "at submission), or queuing it failed (an engine bug, in the core's log)")


# -- frontend -> core --------------------------------------------------------
@dataclass(slots=True)
class NewRequest:
    seq: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float


@dataclass(slots=True)
class AddRequests:
    requests: list[NewRequest]


@dataclass(slots=True)
class AbortRequests:
    seqs: list[int]


@dataclass(slots=True)
class FinishRequests:
    """Requests the frontend ended (a stop string, a failure to detokenize): free them, drop their tokens."""

    seqs: list[int]
    codes: list[Finish]


@dataclass(slots=True)
class StepAck:
    """Synchronous mode: the frontend has processed this step's outputs."""

    step_id: int


@dataclass(slots=True)
class Shutdown:
    pass


# -- core -> frontend --------------------------------------------------------
@dataclass(slots=True)
class CoreReady:
    num_usable_blocks: int
    executor: dict  # Executor.describe()


@dataclass(slots=True)
class LogprobColumns:
    """Logprobs of some of a step's output tokens (``rows``: indices in ``StepOutputs.token_ids``, which are
    the output rows where a row has one token), or of prompt positions (``rows``: the request of each entry).
    ``top_*`` are ``[L, max k]``; entry ``i`` uses its first ``k[i]`` columns."""

    rows: np.ndarray  # [L] int64
    k: np.ndarray  # [L] int64
    chosen: np.ndarray  # [L] float32
    ranks: np.ndarray  # [L] int64
    top_ids: np.ndarray  # [L, K] int64
    top_logprobs: np.ndarray  # [L, K] float32
    token_ids: np.ndarray | None = None  # [L] the scored tokens (prompt positions only)


@dataclass(slots=True)
class StepOutputs:
    """One applied step. Rows are the sampled rows whose token was kept, in plan order.

    A speculative step's rows may carry several tokens each (``num_tokens``): row ``i``'s are the next
    ``num_tokens[i]`` entries of ``token_ids``, in order, and ``finish[i]`` is the code of its last one (every
    token before it goes on). Without ``num_tokens`` a row has one token; a request may then still appear in
    several rows, its tokens in order (``AppliedStep.per_token``)."""

    step_id: int
    seqs: np.ndarray  # [R] int64: the request of each row
    token_ids: np.ndarray  # [R] int64 (or [sum(num_tokens)]): the tokens it sampled
    finish: np.ndarray  # [R] int8 Finish: the row's last token ended the request (EOS, stop token, length)
    ended_seqs: np.ndarray  # [E] int64: requests that ended without a token (abort, error)
    ended_codes: np.ndarray  # [E] int8 Finish
    first_scheduled: np.ndarray  # [F] int64: requests whose first chunk ran in this step
    record: StepRecord | None = None  # the step's timeline (None for a step-less message, e.g. an abort)
    logprobs: LogprobColumns | None = None  # of the rows whose request asked for logprobs
    prompt_logprobs: LogprobColumns | None = None  # prompt positions scored in this step, by request
    num_tokens: np.ndarray | None = None  # [R] int64 tokens per row (speculative steps; None: one each)
    first_cached: np.ndarray | None = None  # [F] int64: each first_scheduled request's prompt tokens reused from
    # the prefix cache (None: none reused)


@dataclass(slots=True)
class CoreFailed:
    message: str
    traceback: str = ""


_EMPTY = np.zeros(0, dtype=np.int64)


def ended_only(seqs: list[int], code: Finish) -> StepOutputs:
    """A message that only ends requests (aborts between steps)."""
    return StepOutputs(-1, _EMPTY, _EMPTY, np.zeros(0, dtype=np.int8), np.asarray(seqs, dtype=np.int64),
                       np.full(len(seqs), code, dtype=np.int8), _EMPTY)


@dataclass(slots=True)
class AppliedStep:
    """What ``Scheduler.apply`` reports for one step, before it becomes ``StepOutputs`` (rows and tokens as
    there: ``num_tokens`` None means one token a row)."""

    seqs: np.ndarray
    token_ids: np.ndarray
    finish: np.ndarray
    errored: list[int] = field(default_factory=list)  # seqs ended by non-finite logits (no token)
    kept: np.ndarray | None = None  # [K] sample index of each row above (None: every sampled row, in order)
    num_tokens: np.ndarray | None = None  # [K] tokens of each row (speculative steps)
    # [K] each row's position in its sampled row's run (``per_token`` rows of a speculative step; None: 0 each)
    positions: np.ndarray | None = None

    def per_token(self) -> AppliedStep:
        """The same step with one token a row (a request's tokens in consecutive rows, the finish code on its
        last), for consumers that read one token a row (grammar matchers). Token order, hence every token's
        index in ``token_ids``, is unchanged."""
        if self.num_tokens is None:
            return self
        counts = self.num_tokens
        finish = np.zeros(len(self.token_ids), dtype=np.int8)
        finish[np.cumsum(counts) - 1] = self.finish
        kept, positions = self.token_keys()
        return AppliedStep(np.repeat(self.seqs, counts), self.token_ids, finish, self.errored, kept,
                           positions=positions)

    def token_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """``[T]`` each token's (sample index, position in that sampled row's run): where its logprobs are
        (``logprob_columns.sampled_columns``)."""
        if self.num_tokens is None:
            kept = np.arange(len(self.seqs)) if self.kept is None else self.kept
            return kept, np.zeros(len(kept), dtype=np.int64) if self.positions is None else self.positions
        counts = self.num_tokens
        kept = np.repeat(np.arange(len(counts)) if self.kept is None else self.kept, counts)
        return kept, np.arange(len(kept)) - np.repeat(np.cumsum(counts) - counts, counts)
