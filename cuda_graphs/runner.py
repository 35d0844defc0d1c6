"""Graphs per (input set, bucket, variant) over one shared memory pool.

One ``StaticBuffers`` *set* per staging buffer of the engine's double buffer: the
copy for step N+1 fills set B while the graph of step N still reads set A.

    staging buffer A ──H2D──► set A ─┬─ graph(A, bucket 8,  greedy)
                                ├─ graph(A, bucket 8,  sample)
                                └─ graph(A, bucket 16, greedy) ...
    staging buffer B ──H2D──► set B ─── graph(B, ...)        all graphs: one memory pool

Every graph allocates its intermediates from the one pool. That is safe
because replays never overlap (they all run on the caller's one compute
stream). Graphs are captured largest bucket first, so smaller ones fit inside
the memory the first one took. What a graph computes in the pool is copied,
as its last kernels, into its set's static outputs, which are outside the
pool: the caller copies step N's outputs to the host on another stream while
step N+1's graph (of the other set) already runs, and that graph's
intermediates may reuse any pool memory, including where step N's graph
left its results. Outputs of set ``s`` are rewritten only by the next replay
of set ``s``, which the caller orders after that copy (as it orders the input
refill).

Bookkeeping invariant: ``(set, bucket, variant)`` has at most one graph, and
its outputs are the tensors ``replay`` returns every time.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from cuda_graphs.buckets import choose_bucket
from cuda_graphs.protocol import CapturableStep, GraphBackend, GraphHandle
from cuda_graphs.static_buffers import StaticBuffers, pad_host_rows


@dataclass(slots=True)
class CapturedGraph:
    set_index: int
    bucket: int
    variant: Hashable
    graph: GraphHandle
    outputs: dict[str, torch.Tensor]  # [bucket, ...] each, rewritten by every replay


@dataclass(slots=True)
class GraphStats:
    num_graphs: int = 0
    capture_s: float = 0.0  # wall time of warm-ups and captures
    pool_bytes: int = 0  # device memory the graphs hold (pool + static outputs), measured in capture_all
    lazy_captures: int = 0  # graphs captured on first use rather than up front
    replays: int = 0

    def as_dict(self) -> dict:
        return {"num_graphs": self.num_graphs, "capture_s": self.capture_s, "pool_bytes": self.pool_bytes,
                "lazy_captures": self.lazy_captures, "replays": self.replays}


@dataclass(slots=True)
class GraphRunner:
    """Bucket choice, padding, static-buffer refill, capture and replay for one ``CapturableStep``."""

    step: CapturableStep
    batch_sizes: tuple[int, ...]
    num_sets: int
    device: torch.device
    backend: GraphBackend
    warmup: int = 2
    sets: list[StaticBuffers] = field(init=False)
    stats: GraphStats = field(init=False, default_factory=GraphStats)
    _pool: object = field(init=False)
    _graphs: dict[tuple[int, int, Hashable], CapturedGraph] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        sizes = tuple(self.batch_sizes)
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"batch_sizes must be sorted, unique and positive, got {sizes}")
        if self.num_sets < 1:
            raise ValueError(f"num_sets must be >= 1, got {self.num_sets}")
        self.batch_sizes = sizes
        specs = self.step.input_specs()
        outputs = self.step.output_specs()
        self.sets = [StaticBuffers(specs, sizes[-1], self.device, outputs) for _ in range(self.num_sets)]
        self._pool = self.backend.new_pool()

    @property
    def max_rows(self) -> int:
        return self.batch_sizes[-1]

    def bucket_for(self, rows: int) -> int | None:
        """The bucket a step of ``rows`` rows replays, or None if it must run eagerly."""
        return choose_bucket(self.batch_sizes, rows)

    def has(self, set_index: int, bucket: int, variant: Hashable) -> bool:
        return (set_index, bucket, variant) in self._graphs

    # -- capture ----------------------------------------------------------------
    def capture(self, set_index: int, bucket: int, variant: Hashable, lazy: bool = False) -> CapturedGraph:
        """Capture the graph of ``(set_index, bucket, variant)`` unless it exists.

        Resets the set's static buffers to padding first: warm-up runs for real,
        and on padding rows it writes only where padding points. The caller
        must make sure no replay that reads the set is still pending.
        """
        key = (set_index, bucket, variant)
        found = self._graphs.get(key)
        if found is not None:
            return found
        if bucket not in self.batch_sizes:
            raise ValueError(f"{bucket} is not one of the batch sizes {self.batch_sizes}")
        buffers = self.sets[set_index]
        buffers.reset()
        views, outputs = buffers.views(bucket), buffers.output_views(bucket)
        step = self.step

        def run() -> dict[str, torch.Tensor]:
            produced = step.run(views, variant)
            if not produced.keys() <= outputs.keys():  # a variant may write some of the outputs only
                raise ValueError(f"the step returned {sorted(produced)}, its output_specs say {sorted(outputs)}")
            for name, value in produced.items():
                outputs[name].copy_(value)
            return outputs

        before, start = self.backend.memory_reserved(), time.perf_counter()
        graph, outputs = self.backend.capture(run, self._pool, self.warmup)  # outputs: the set's static ones
        self.stats.capture_s += time.perf_counter() - start
        if lazy:  # approximate: may include blocks the warm-up left in the allocator's cache
            self.stats.pool_bytes += max(0, self.backend.memory_reserved() - before)
        self.stats.num_graphs += 1
        self.stats.lazy_captures += int(lazy)
        captured = CapturedGraph(set_index, bucket, variant, graph, outputs)
        self._graphs[key] = captured
        return captured

    def capture_all(self, variants: Iterable[Hashable]) -> None:
        """Capture every set × bucket × variant, largest bucket first.

        The pool's size is measured around the whole batch with the allocator's
        cache emptied on both sides, so warm-up memory does not count (this
        synchronizes the device: call it before serving).
        """
        variants = list(variants)
        self.backend.release_cached()
        before = self.backend.memory_reserved()
        for bucket in reversed(self.batch_sizes):  # sorted ascending at construction
            for set_index in range(self.num_sets):
                for variant in variants:
                    self.capture(set_index, bucket, variant)
        self.backend.release_cached()
        self.stats.pool_bytes += max(0, self.backend.memory_reserved() - before)

    # -- one step -------------------------------------------------------------------
    def prepare(self, set_index: int, host: Mapping[str, np.ndarray], rows: int, bucket: int) -> None:
        """``pack`` then ``upload``."""
        self.pack(set_index, host, rows, bucket)
        self.upload(set_index, bucket)

    def pack(self, set_index: int, host: Mapping[str, np.ndarray], rows: int, bucket: int) -> None:
        """Pad host rows ``[rows, bucket)`` and pack rows ``[0, bucket)`` into the set's pinned host block: the
        host's share, done before the copy is enqueued so that events around the copy time the copy alone."""
        if not 1 <= rows <= bucket:
            raise ValueError(f"rows must be in [1, bucket={bucket}], got {rows}")
        buffers = self.sets[set_index]
        pad_host_rows(host, buffers.specs, rows, bucket)
        buffers.pack(host, bucket)

    def upload(self, set_index: int, bucket: int) -> None:
        """Copy rows ``[0, bucket)`` of the set's packed host block into its static inputs, on the current
        stream."""
        self.sets[set_index].upload(bucket)

    def replay(self, set_index: int, bucket: int, variant: Hashable) -> dict[str, torch.Tensor]:
        """Replay on the current stream; returns the graph's static outputs (``[bucket, ...]``)."""
        captured = self._graphs.get((set_index, bucket, variant))
        if captured is None:
            raise KeyError(f"no graph for set {set_index}, bucket {bucket}, variant {variant!r}; capture it first")
        captured.graph.replay()
        self.stats.replays += 1
        return captured.outputs
