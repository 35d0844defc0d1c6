"""Bytes held by tensors and modules, each storage counted once (weights tied to the LM head, KV views)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

_MIB = 1 << 20


def tensor_mib(tensors: Iterable[torch.Tensor]) -> float:
    """MiB of storage behind ``tensors``, each storage counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / _MIB


def module_mib(module: torch.nn.Module) -> float:
    """MiB of a module's parameters and buffers (tied weights once)."""
    return tensor_mib([*module.parameters(), *module.buffers()])
