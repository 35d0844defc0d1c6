"""Static input buffers of the captured graphs, and the padding rows in front of them.

A graph reads its inputs from fixed device addresses, so every replay first
refills them. A step of ``rows`` real rows replayed in bucket ``bucket``:

    host arrays  [ real rows 0..rows | pad rows..bucket | (unused) ]   pad_host_rows writes the pad values
                        │ one non-blocking copy per buffer, rows 0..bucket, on the caller's stream
                        ▼
    static       [ real rows 0..rows | pad rows..bucket | stale     ]   the graph of ``bucket`` reads 0..bucket

Padding is written into the host arrays (a few small numpy fills) rather than
on the device, so the refill is exactly one host-to-device copy per buffer
and the device runs nothing extra. Rows past the bucket are never read.

The set's outputs live here too, allocated like the inputs (outside the
graphs' shared memory pool): every graph of the set ends by copying its
results into them, so what a replay returns is overwritten only by the next
replay of the *same* set, never by another graph reusing pool memory.

Invariant: the host arrays are pinned and must not be rewritten until the
copies out of them have completed (the caller's fence), and the static buffers
must not be refilled while a replay that reads them, or a copy out of its
outputs, may still run (the caller's event).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from cuda_graphs.protocol import BufferSpec, OutputSpec


def pad_host_rows(host: Mapping[str, np.ndarray], specs: Sequence[BufferSpec], start: int, stop: int) -> None:
    """Write each spec's pad value into rows ``[start, stop)`` of its host array."""
    if stop <= start:
        return
    for spec in specs:
        host[spec.host][start:stop] = spec.pad


class StaticBuffers:
    """Device tensors ``[max_rows, *tail]``, one per input and output spec, at addresses that never change."""

    def __init__(self, specs: Sequence[BufferSpec], max_rows: int, device: torch.device | str,
                 output_specs: Sequence[OutputSpec] = ()) -> None:
        for kind, group in (("buffer", specs), ("output", output_specs)):
            names = [s.name for s in group]
            if len(set(names)) != len(names):
                raise ValueError(f"{kind} names must be unique, got {names}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.specs = tuple(specs)
        self.max_rows = max_rows
        self.tensors: dict[str, torch.Tensor] = {
            s.name: torch.full((max_rows, *s.tail), s.pad, dtype=s.dtype, device=device) for s in specs}
        self.outputs: dict[str, torch.Tensor] = {
            s.name: torch.zeros((max_rows, *s.tail), dtype=s.dtype, device=device) for s in output_specs}

    def views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of every buffer: what a graph of bucket ``rows`` reads."""
        self._check_rows(rows)
        return {name: t[:rows] for name, t in self.tensors.items()}

    def output_views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of every output: what a graph of bucket ``rows`` writes."""
        self._check_rows(rows)
        return {name: t[:rows] for name, t in self.outputs.items()}

    def load(self, host: Mapping[str, np.ndarray], rows: int) -> None:
        """Copy rows ``[0, rows)`` of every host array in, non-blocking, on the current stream."""
        self._check_rows(rows)
        for spec in self.specs:
            source = torch.from_numpy(host[spec.host][:rows])
            self.tensors[spec.name][:rows].copy_(source, non_blocking=True)

    def reset(self) -> None:
        """Every row becomes padding (on the current stream): warm-up and capture then write only where
        padding points, so capturing never disturbs real state."""
        for spec in self.specs:
            self.tensors[spec.name].fill_(spec.pad)

    def _check_rows(self, rows: int) -> None:
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows must be in [1, {self.max_rows}], got {rows}")
