"""The contract between this package and the engine whose step it captures.

The engine describes its step's per-row inputs as ``BufferSpec``s and gives a
``CapturableStep``; this package owns the static buffers, the padding, the
graphs and their memory pool, and knows nothing else about the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One static input: ``[rows, *tail]`` of ``dtype``, filled from the host array ``host``.

    ``pad`` is the value every padding row holds. It must make a padding row
    harmless: whatever the step writes for that row must land somewhere no real
    row reads (a dummy KV block, a dummy token row), and it must not produce
    NaN or out-of-range indices.
    """

    name: str
    tail: tuple[int, ...]
    dtype: torch.dtype
    pad: int | float
    host: str  # name of the host array the rows are copied from


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One static output: ``[rows, *tail]`` of ``dtype``, rewritten by every replay of the set's graphs."""

    name: str
    tail: tuple[int, ...]
    dtype: torch.dtype


class CapturableStep(Protocol):
    """A step program a CUDA graph can capture.

    Invariants the implementation keeps:
      * it reads only its static inputs and state whose addresses never change
        (weights, KV cache, a token buffer), and writes only its returned
        outputs and that state;
      * it does not synchronize with the host and has no data-dependent shapes;
      * running it on padding rows only writes where padding points.
    """

    def input_specs(self) -> Sequence[BufferSpec]: ...

    def output_specs(self) -> Sequence[OutputSpec]:
        """What ``run`` may return, by name: one ``[rows, *tail]`` tensor per spec (a variant may return some of
        them only; the others keep what an earlier replay of the set wrote)."""
        ...

    def run(self, inputs: Mapping[str, torch.Tensor], variant: Hashable) -> dict[str, torch.Tensor]:
        """Run the step on ``len(rows)`` rows, ``inputs`` being ``[rows, *tail]`` views."""
        ...


class GraphHandle(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """How graphs are captured: CUDA graphs, or eager re-execution for CPU tests."""

    def new_pool(self) -> object: ...

    def capture(self, fn: Callable[[], dict[str, torch.Tensor]], pool: object,
                warmup: int) -> tuple[GraphHandle, dict[str, torch.Tensor]]:
        """Warm ``fn`` up ``warmup`` times, then capture it; returns the graph and its static outputs."""
        ...

    def memory_reserved(self) -> int:
        """Bytes the device allocator holds now (0 where not measurable)."""
        ...

    def release_cached(self) -> None:
        """Wait for the device and return the allocator's unused cached blocks (not the graphs' pool)."""
        ...
