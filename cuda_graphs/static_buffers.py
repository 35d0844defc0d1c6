"""Static input buffers of the captured graphs, and the padding rows in front of them.

A graph reads its inputs from fixed device addresses, so every replay first
refills them. A step of ``rows`` real rows replayed in bucket ``bucket``:

    host arrays  [ real rows 0..rows | pad rows..bucket | (unused) ]   pad_host_rows writes the pad values
                        │ packed on the host: each input's rows 0..bucket into one pinned block
                        ▼
    host block   [ input 1 | input 2 | ... | widest input, rows 0..bucket | (rest) ]
                        │ ONE non-blocking copy, on the caller's stream, of the block's prefix
                        ▼
    static       [ the same layout on the device; the graph of ``bucket`` reads rows 0..bucket of each ]

The inputs live in one device block, each a view at a fixed offset, the
widest (the block tables) last; a refill copies the block from its start to
the end of the widest input's row ``bucket``: every other input whole (a few
KiB), the widest one's first ``bucket`` rows. One copy instead of one per
input: each copy is a driver call (tens of microseconds on a virtualised
host) and a separate transfer on the device (11 of them took 0.28 ms a step
on an H200: profiles/gpu-check-nvidia-h200-2026-12-04). Rows past the bucket
of the other inputs then hold whatever the host block held there: never
read, since a graph of ``bucket`` reads rows ``0..bucket`` only.

Padding is written into the host arrays (a few small numpy fills) rather than
on the device, so the device runs nothing extra.

The set's outputs live here too, allocated like the inputs (outside the
graphs' shared memory pool): every graph of the set ends by copying its
results into them, so what a replay returns is overwritten only by the next
replay of the *same* set, never by another graph reusing pool memory.

Invariant: the host arrays and the set's host block must not be rewritten
until the copy out of them has completed (the caller's fence: the host block
of set ``s`` is packed by the launch that refills set ``s``, after the planner
waited for the copy of the previous one), and the static buffers must not be
refilled while a replay that reads them, or a copy out of its outputs, may
still run (the caller's event).
"""

from __future__ import annotations

import math
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


_ALIGN = 16  # bytes: every input's view starts at a multiple of this in the block


def _nbytes(spec: BufferSpec, rows: int) -> int:
    return rows * math.prod(spec.tail) * torch.empty((), dtype=spec.dtype).element_size()


class StaticBuffers:
    """Device tensors ``[max_rows, *tail]``, one per input and output spec, at addresses that never change.

    The inputs are views into one device block, mirrored by a host block (pinned where the device is a GPU)
    that ``load`` packs and copies in one go; see the module docstring."""

    def __init__(self, specs: Sequence[BufferSpec], max_rows: int, device: torch.device | str,
                 output_specs: Sequence[OutputSpec] = ()) -> None:
        for kind, group in (("buffer", specs), ("output", output_specs)):
            names = [s.name for s in group]
            if len(set(names)) != len(names):
                raise ValueError(f"{kind} names must be unique, got {names}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        device = torch.device(device)
        self.specs = tuple(specs)
        self.max_rows = max_rows
        # The widest input last: only its first rows travel; stable, so equal widths keep the specs' order.
        self._packed = tuple(sorted(self.specs, key=lambda s: math.prod(s.tail)))
        self._offsets: dict[str, int] = {}
        end = 0
        for spec in self._packed:
            self._offsets[spec.name] = end
            end += -(-_nbytes(spec, max_rows) // _ALIGN) * _ALIGN
        self._device_block = torch.empty(max(end, _ALIGN), dtype=torch.uint8, device=device)
        self._host_block = torch.zeros(max(end, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.tensors = {spec.name: self._view(self._device_block, spec) for spec in self.specs}
        self._host = {spec.name: self._view(self._host_block, spec).numpy() for spec in self.specs}
        for spec in self.specs:
            self.tensors[spec.name].fill_(spec.pad)
            self._host[spec.name][...] = spec.pad
        self.outputs: dict[str, torch.Tensor] = {
            s.name: torch.zeros((max_rows, *s.tail), dtype=s.dtype, device=device) for s in output_specs}

    def _view(self, block: torch.Tensor, spec: BufferSpec) -> torch.Tensor:
        start = self._offsets[spec.name]
        return block[start:start + _nbytes(spec, self.max_rows)].view(spec.dtype).view(self.max_rows, *spec.tail)

    @property
    def host_block(self) -> torch.Tensor:
        """The host side of the inputs' block (what ``load`` packs; tests watch it)."""
        return self._host_block

    def views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of every buffer: what a graph of bucket ``rows`` reads."""
        self._check_rows(rows)
        return {name: t[:rows] for name, t in self.tensors.items()}

    def output_views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of every output: what a graph of bucket ``rows`` writes."""
        self._check_rows(rows)
        return {name: t[:rows] for name, t in self.outputs.items()}

    def load(self, host: Mapping[str, np.ndarray], rows: int) -> None:
        """``pack`` then ``upload``."""
        self.pack(host, rows)
        self.upload(rows)

    def pack(self, host: Mapping[str, np.ndarray], rows: int) -> None:
        """Pack rows ``[0, rows)`` of every host array into the host block (host work only). The caller
        guarantees that no copy out of the host block is still in flight (the engine: its staging fence)."""
        self._check_rows(rows)
        for spec in self.specs:
            self._host[spec.name][:rows] = host[spec.host][:rows]

    def upload(self, rows: int) -> None:
        """Copy the host block's prefix that holds rows ``[0, rows)`` to the device in one non-blocking copy,
        on the current stream."""
        self._check_rows(rows)
        if not self._packed:
            return
        last = self._packed[-1]
        end = self._offsets[last.name] + _nbytes(last, rows)
        self._device_block[:end].copy_(self._host_block[:end], non_blocking=True)

    def reset(self) -> None:
        """Every row becomes padding (on the current stream): warm-up and capture then write only where
        padding points, so capturing never disturbs real state."""
        for spec in self.specs:
            self.tensors[spec.name].fill_(spec.pad)

    def _check_rows(self, rows: int) -> None:
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows must be in [1, {self.max_rows}], got {rows}")
