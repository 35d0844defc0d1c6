"""Capture and replay of decode steps per batch-size bucket.

The engine hands over a ``CapturableStep`` (its decode step as a function of
static per-row inputs described by ``BufferSpec``s); ``GraphRunner`` owns one
set of static buffers per staging buffer, pads each step up to its bucket with
harmless rows, refills the buffers with one copy per input, and replays the
graph of ``(set, bucket, variant)``, all graphs sharing one memory pool.
Nothing here imports the engine; ``EagerBackend`` runs the same bookkeeping
on CPU for tests.
"""

from cuda_graphs.backends import CudaGraphBackend, EagerBackend
from cuda_graphs.buckets import choose_bucket, default_batch_sizes, normalize_batch_sizes
from cuda_graphs.protocol import BufferSpec, CapturableStep, GraphBackend, OutputSpec
from cuda_graphs.runner import CapturedGraph, GraphRunner, GraphStats
from cuda_graphs.static_buffers import StaticBuffers, pad_host_rows

__all__ = [
    "BufferSpec", "CapturableStep", "CapturedGraph", "CudaGraphBackend", "EagerBackend", "GraphBackend",
    "GraphRunner", "GraphStats", "OutputSpec", "StaticBuffers", "choose_bucket", "default_batch_sizes",
    "normalize_batch_sizes", "pad_host_rows",
]
