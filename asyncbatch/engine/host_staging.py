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

The buffer and its fence are part of the step contract (``step_contract``), which the
executors read; this module owns only the pairing.
"""

from __future__ import annotations

from asyncbatch.engine.step_contract import Fence, StagingBuffer

__all__ = ["Fence", "StagingBuffer", "StagingPair"]  # the buffer itself is the step contract's


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
