"""A request's state as the planner sees it.

Token accounting (the planner runs one step ahead, so some sampled tokens are
still on the device):

    prompt_token_ids + output_token_ids          known on the host
    + num_pending                                sampled by launched steps, not yet received
    = num_tokens                                 what the sequence will hold once they arrive

``num_computed_tokens`` counts tokens whose key/value has been scheduled into
the KV cache (launched steps included). A request in the decode phase has
``num_computed_tokens == num_tokens - 1``: its newest token is the next input,
and it lives in the device token buffer at ``token_row``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from asyncbatch.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds a token row and KV blocks
    DRAINING = "draining"  # every token it will ever get is scheduled; awaits the in-flight ones
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    arrival_seq: int  # FIFO order of submission
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # effective sampling seed (the params' seed, or one derived from the engine's)
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    num_pending: int = 0
    num_computed_tokens: int = 0
    prefill_len: int = 0  # tokens to (re)compute before decoding: prompt (+ outputs after a preemption)
    token_row: int | None = None
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    handle: Any = None  # the caller's RequestHandle, filled only by the output thread

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending

    @property
    def num_scheduled_outputs(self) -> int:
        """Outputs received plus outputs a launched step will produce."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.prefill_len

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
