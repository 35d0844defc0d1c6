"""A request's state as the planner sees it: the Python half, touched only when the request changes state.

While a request holds a token row (``token_row`` is not None: it is running,
or drained and not yet released) its counters live in the scheduler's
``RowState`` arrays at that row, and a decode step touches nothing here. The
counters below are authoritative only while it holds no row (waiting, or
drained/preempted/finished with tokens still in flight); the scheduler copies
them out of the arrays when it releases the row.

Token accounting (the planner runs one step ahead, so some sampled tokens are
still on the device):

    len(prompt_token_ids) + num_outputs          known on the host
    + num_pending                                sampled by launched steps, not yet received
    = the tokens the sequence will hold once they arrive

``output_token_ids`` holds what a preempted request must recompute: the row's
output history is copied here when it is preempted, and tokens that arrive
while it waits are appended. Otherwise it stays empty: outputs go to the
frontend in each step's columnar ``AppliedStep``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from asyncbatch.engine.prefix_cache import salted_root
from asyncbatch.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds a token row and KV blocks
    DRAINING = "draining"  # every token it will ever get is scheduled; awaits the in-flight ones
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    arrival_seq: int  # FIFO order of submission; the request's key (``seq``) in messages and plans
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # effective sampling seed (the params' seed, or one derived from the engine's)
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)  # outputs to recompute (see module doc)
    num_outputs: int = 0  # outputs received (while the request holds no token row)
    num_pending: int = 0  # outputs sampled by launched steps, not yet received (likewise)
    token_row: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt logprobs: the next prompt position whose token is still to be scored (position 0 never is).
    # Planned positions are never scored again, so a recompute after preemption adds none.
    prompt_logprobs_next: int = 1
    # Chain keys and token tuples of the full blocks of the tokens known so far (``prefix_cache.chain_keys``):
    # computed at the first admission with prefix caching on, extended when outputs fill more blocks.
    block_keys: list[int] = field(default_factory=list)
    block_contents: list[tuple[int, ...]] = field(default_factory=list)
    # (root key, root serial) its chain starts from: ``prefix_cache.ROOT``, or its cache salt's (``salted_root``).
    cache_root: tuple[int, int] = field(init=False)
    # Its parameters as ``RowState.admit_many`` writes them (``RowState.constants_of``), computed on arrival.
    row_constants: bytes = b""
    # Its prompt as an int64 array (made with the request, off the planner's path): an admission burst joins the
    # prompts with one ``np.concatenate`` instead of converting every token from a list.
    prompt_array: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int64)
        self.cache_root = salted_root(self.params.cache_salt)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def all_token_ids(self) -> list[int]:
        """Prompt and outputs to recompute after a preemption."""
        return self.prompt_token_ids + self.output_token_ids

    def chunk_tokens(self, start: int, end: int) -> np.ndarray:
        """Tokens ``start .. end - 1`` as int64: the prompt array itself for the whole prompt, else a view of it,
        or converted where the chunk reaches outputs to recompute after a preemption."""
        prompt = self.prompt_array
        if end <= len(prompt):
            return prompt if start == 0 and end == len(prompt) else prompt[start:end]
        return np.asarray(self.all_token_ids()[start:end], dtype=np.int64)
