"""Two preallocated staging buffers that carry one step's metadata to the device.

Each staging buffer is a set of numpy views over host memory (pinned on CUDA, so the
host-to-device copy is a true asynchronous DMA). The planner writes buffer A
while the device consumes buffer B:

    planner   [write A: step N]      [wait fence B][write B: step N+1]  [wait fence A][write A ...
    H2D                  [copy A]                        [copy B]
    device                  [ step N ..................... ][ step N+1 ...........

Invariant: a staging buffer is written only after its fence has fired, i.e. after the
copy out of it (launched for the step that last used it) has completed. The
fence is a CUDA event on ``cuda`` and a ``threading.Event`` that the device
thread sets after its copy on ``cpu``/``sim``. With two buffers and at most two
launched steps, the planner's wait for step N's tokens already orders the
rewrite of N's buffer after N's copy; the fence keeps the invariant whatever the
pipeline depth, at the cost of one event check per step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch


class Fence:
    """Signalled once the last copy out of a staging buffer has finished."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._event.set()
        self._cuda_event: torch.cuda.Event | None = None

    def arm(self) -> None:
        self._event.clear()
        self._cuda_event = None

    def signal(self) -> None:
        self._event.set()

    def signal_with_cuda_event(self, event: torch.cuda.Event) -> None:
        self._cuda_event = event
        self._event.set()

    def wait(self) -> None:
        self._event.wait()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()


def _host_array(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> np.ndarray:
    tensor = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
    return tensor.numpy()


@dataclass(slots=True)
class StagingBuffer:
    """Metadata buffers for one step. Sizes: T tokens, S rows, B blocks per row."""

    index: int
    input_ids: np.ndarray  # [T] int64 (decode rows' entries are overwritten on device)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, flat KV index per token
    token_is_output: np.ndarray  # [T] bool, for penalties when a preempted request is recomputed
    token_owner_row: np.ndarray  # [T] int64, token row of the row each token belongs to
    decode_token_rows: np.ndarray  # [S] int64, where decode rows read their input token
    decode_block_tables: np.ndarray  # [S, B] int64
    decode_context_lens: np.ndarray  # [S] int64
    prefill_block_tables: np.ndarray  # [S, B] int64
    prefill_row_spans: np.ndarray  # [S, 3] int64: token_start, q_len, ctx_len of each prefill row
    first_chunk_token_rows: np.ndarray  # [S] int64: token rows whose request (re)starts its prefill
    logits_indices: np.ndarray  # [S] int64
    sample_token_rows: np.ndarray  # [S] int64, where sampled tokens are written
    sample_seed: np.ndarray  # [S] int64
    sample_step: np.ndarray  # [S] int64
    sample_top_k: np.ndarray  # [S] int64
    sample_temperature: np.ndarray  # [S] float32
    sample_top_p: np.ndarray  # [S] float32
    sample_min_p: np.ndarray  # [S] float32
    sample_presence: np.ndarray  # [S] float32
    sample_frequency: np.ndarray  # [S] float32
    sample_repetition: np.ndarray  # [S] float32
    fence: Fence = field(default_factory=Fence)

    @classmethod
    def allocate(cls, index: int, max_tokens: int, max_rows: int, max_blocks: int, pinned: bool) -> StagingBuffer:
        i64, f32 = torch.int64, torch.float32
        return cls(
            index=index,
            input_ids=_host_array((max_tokens,), i64, pinned),
            positions=_host_array((max_tokens,), i64, pinned),
            slot_mapping=_host_array((max_tokens,), i64, pinned),
            token_is_output=_host_array((max_tokens,), torch.bool, pinned),
            token_owner_row=_host_array((max_tokens,), i64, pinned),
            decode_token_rows=_host_array((max_rows,), i64, pinned),
            decode_block_tables=_host_array((max_rows, max_blocks), i64, pinned),
            decode_context_lens=_host_array((max_rows,), i64, pinned),
            prefill_block_tables=_host_array((max_rows, max_blocks), i64, pinned),
            prefill_row_spans=_host_array((max_rows, 3), i64, pinned),
            first_chunk_token_rows=_host_array((max_rows,), i64, pinned),
            logits_indices=_host_array((max_rows,), i64, pinned),
            sample_token_rows=_host_array((max_rows,), i64, pinned),
            sample_seed=_host_array((max_rows,), i64, pinned),
            sample_step=_host_array((max_rows,), i64, pinned),
            sample_top_k=_host_array((max_rows,), i64, pinned),
            sample_temperature=_host_array((max_rows,), f32, pinned),
            sample_top_p=_host_array((max_rows,), f32, pinned),
            sample_min_p=_host_array((max_rows,), f32, pinned),
            sample_presence=_host_array((max_rows,), f32, pinned),
            sample_frequency=_host_array((max_rows,), f32, pinned),
            sample_repetition=_host_array((max_rows,), f32, pinned),
        )


class StagingPair:
    """The double buffer: buffers are used alternately, each behind its fence."""

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, pinned: bool) -> None:
        self.buffers = (StagingBuffer.allocate(0, max_tokens, max_rows, max_blocks, pinned),
                      StagingBuffer.allocate(1, max_tokens, max_rows, max_blocks, pinned))
        self._next = 0

    def next_buffer(self) -> StagingBuffer:
        staging = self.buffers[self._next]
        self._next ^= 1
        return staging
