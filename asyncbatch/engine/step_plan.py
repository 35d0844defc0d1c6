"""What the scheduler decides for one step: plain data, no tensors.

The decode part is arrays over token rows (one token each, admission order);
prefill chunks are a short list of ``ScheduledRow``. Sampled rows, in the order
the executor returns their tokens, are the decode rows, then the prefill rows
whose chunk ends their prefill (``ScheduledRow.samples``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asyncbatch.engine.request import Request


@dataclass(slots=True)
class ScheduledRow:
    """One prefill chunk: tokens ``start .. start + num_tokens - 1`` of the request's prompt (+ outputs).

    A first chunk starts at ``num_cached`` (0 without a cache hit, else a multiple of the block size below the
    prefill length, so its last token is always computed and yields logits).
    """

    request: Request
    token_row: int
    start: int  # position of the first token computed in this step
    num_tokens: int
    samples: bool  # the chunk ends the prefill, and its last token produces the next output
    sample_step: int  # outputs scheduled before this one (the seeded-noise counter); 0 when not sampling
    first: bool = False  # the request's first chunk since its (re)admission
    num_cached: int = 0  # first chunk only: tokens before ``start`` reused from the prefix cache


# Columns of a chunk table: one int64 row per prefill chunk (``StepPlan.admitted``; ``write_prefill`` builds
# the same for the other chunks): its token row, first position, token count, the request's prompt length, its
# sample step, whether it samples, whether it is the first chunk since the (re)admission, the tokens reused from
# the prefix cache before it (first chunks), its first token's offset among the plan's prefill tokens of the
# same table, the blocks it reaches (``blocks_for(start + n)``), its end (``start + n``) and the request's
# arrival_seq (admitted chunks only).
(CHUNK_ROW, CHUNK_START, CHUNK_N, CHUNK_PROMPT, CHUNK_STEP, CHUNK_SAMPLES, CHUNK_FIRST, CHUNK_CACHED, CHUNK_OFFSET,
 CHUNK_BLOCKS, CHUNK_END, CHUNK_SEQ) = range(12)
CHUNK_COLUMNS = CHUNK_SEQ + 1


def sampling_chunks(chunks: np.ndarray, num_sampling: int) -> slice | np.ndarray:
    """An index of the rows of a chunk table ``chunks`` that sample, given how many do (the plan counts them): all
    of them or all but a chunked last one (a burst's admitting step) as a slice, which costs no mask, else a mask."""
    if num_sampling == len(chunks):
        return slice(None)
    if num_sampling == len(chunks) - 1 and not chunks[-1, CHUNK_SAMPLES]:
        return slice(-1)
    return chunks[:, CHUNK_SAMPLES] != 0


@dataclass(slots=True)
class StepPlan:
    step_id: int
    decode_rows: np.ndarray  # [D] int64 token rows, admission order (read-only; may be shared across plans)
    decode_seqs: np.ndarray  # [D] int64 their requests' seqs
    decode_positions: np.ndarray  # [D] int64 position of each row's input token
    decode_steps: np.ndarray  # [D] int64 sample step: outputs scheduled before this one
    decode_grew: np.ndarray  # [G] int64 indices into decode_rows of rows given a block in this step
    decode_version: int  # equal versions <=> equal decode_rows
    prefill: list[ScheduledRow]  # chunks in order: running prefills first, then admissions
    num_tokens: int
    sample_rows: np.ndarray  # [R] int64 token rows of the sampled rows, in output order
    sample_seqs: np.ndarray  # [R] int64 their requests' seqs
    release_epoch: int  # Scheduler.num_releases when planned: unchanged means every row still has its request
    preempted: list[Request] = field(default_factory=list)
    drained: list[Request] = field(default_factory=list)
    num_admitted: int = 0  # waiting requests admitted by this plan (their first chunks end ``prefill``)
    # Planner seconds spent admitting them: the scheduler's admission (rows and block allocation), then the metadata
    # writer's prefill rows (added when it writes the plan). ``admission_us_per_request`` in ``stats()``.
    admit_s: float = 0.0
    # Speculative engines: drafts each decode row verifies in this step (its tokens: 1 + spec_depth, the input
    # token and the drafts); ``decode_positions`` is then the last position reserved for each row.
    spec_depth: int = 0
    # [num_admitted, CHUNK_COLUMNS] int64: the chunk table of the admitted chunks, the last ``num_admitted`` of
    # ``prefill`` (``Admitter.table``), so that the sampled rows and ``write_prefill`` take them without a Python
    # pass.
    admitted: np.ndarray | None = None
    # The planner thread's CPU seconds in ``admit_s`` (``admission_cpu_us_per_request``): wall time less what
    # the machine's other threads and processes took from it.
    admit_cpu_s: float = 0.0
    # Their tokens, one int64 array per admitted chunk in the same order (``Admitter.tokens``).
    admitted_tokens: list[np.ndarray] = field(default_factory=list)
    # Whether an admitted chunk reaches its request's outputs (a recompute after a preemption; ``Admitter``):
    # without one, no admitted token is an output, which ``write_prefill`` then need not look for.
    admitted_reach_outputs: bool = False

    @property
    def num_decode(self) -> int:
        return len(self.decode_rows)

    @property
    def num_decode_tokens(self) -> int:
        """The decode rows' tokens: one each, or ``1 + spec_depth`` each in a verify step."""
        return len(self.decode_rows) * (self.spec_depth + 1)

    @property
    def num_prefill(self) -> int:
        return len(self.prefill)

    @property
    def num_sampled(self) -> int:
        return len(self.sample_rows)

    def first_scheduled(self) -> tuple[np.ndarray, np.ndarray]:
        """Requests whose prompt starts (or, after a preemption, restarts) in this step, and the tokens of each
        one's prompt reused from the prefix cache at that start (``[F]`` int64 each)."""
        firsts = [row for row in self.prefill if row.first]
        return (np.asarray([row.request.arrival_seq for row in firsts], dtype=np.int64),
                np.asarray([row.num_cached for row in firsts], dtype=np.int64))
