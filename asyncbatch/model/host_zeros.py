"""Zeroed CPU tensors that cost nothing until they are written.

``torch.zeros`` on the CPU allocates and then writes every byte: for the CPU
engine's default KV cache (2 GiB) that is 1-4 s of every engine's start-up
(the kernel faults each page in), paid again by every test and every replica.
``numpy.zeros`` asks ``calloc``, which maps large blocks as fresh anonymous
pages that the kernel already guarantees to be zero: nothing is touched until a
step writes a block, and memory that is never used is never resident.

Invariant: the tensor reads as zeros everywhere (as ``torch.zeros`` would), owns
its memory through the numpy array it views, and starts on a 64-byte boundary
(SIMD loads of the attention kernels, like torch's own allocator).
"""

from __future__ import annotations

import math

import numpy as np
import torch

_ALIGN = 64


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of ``shape`` and ``dtype``, backed by ``calloc``'d memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes + _ALIGN, dtype=np.uint8))
    offset = -raw.data_ptr() % _ALIGN
    return raw[offset:offset + nbytes].view(dtype).view(shape)
