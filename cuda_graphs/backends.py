"""Graph backends: real CUDA graphs, and an eager stand-in so the bookkeeping runs on CPU.

``CudaGraphBackend.capture``, on its own side stream (graphs cannot be
captured on the legacy default stream, and a side stream keeps warm-up work
out of the engine's streams):

    caller stream  ──●(wait)······························●(wait)──►
    side stream        [warm-up × n][capture_begin · fn() · capture_end]
                       ran eagerly   recorded, not run: outputs are static

Warm-up runs ``fn`` eagerly first so lazy initialisation (cuBLAS handles and
workspaces, Triton compilation, the caching allocator's first blocks) happens
outside the capture. Capture uses ``capture_error_mode="thread_local"`` so
other threads' CUDA calls (output processing, a profiler) do not invalidate
it, and no device-wide synchronize is issued (``torch.cuda.graph`` would issue
one), so capturing a missing graph mid-run costs host time only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CudaGraphBackend:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def new_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], dict[str, torch.Tensor]], pool: object,
                warmup: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            for _ in range(warmup):
                fn()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = fn()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass  # the capture was already invalidated by the error being raised
                raise
            graph.capture_end()
        caller.wait_stream(self.stream)
        return graph, outputs

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


class _EagerGraph:
    """Re-runs the function and copies into the outputs captured first, as a replay would fill them."""

    def __init__(self, fn: Callable[[], dict[str, torch.Tensor]], outputs: dict[str, torch.Tensor]) -> None:
        self._fn = fn
        self._outputs = outputs

    def replay(self) -> None:
        for name, value in self._fn().items():
            self._outputs[name].copy_(value)


class EagerBackend:
    """For CPU tests: 'capture' runs the function (a CUDA capture would only record it) and keeps its
    outputs as the static outputs; 'replay' runs it again and refreshes them in place."""

    def __init__(self) -> None:
        self.captures = 0

    def new_pool(self) -> object:
        return None

    def capture(self, fn: Callable[[], dict[str, torch.Tensor]], pool: object,
                warmup: int) -> tuple[_EagerGraph, dict[str, torch.Tensor]]:
        for _ in range(warmup):
            fn()
        self.captures += 1
        outputs = fn()
        return _EagerGraph(fn, outputs), outputs

    def memory_reserved(self) -> int:
        return 0

    def release_cached(self) -> None:
        pass
