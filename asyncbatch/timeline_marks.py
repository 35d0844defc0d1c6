"""NVTX ranges for Nsight Systems, in the ``asyncbatch`` domain.

``mark`` is a no-op context manager unless NVTX is enabled (``ASYNCBATCH_NVTX=1``
or ``enable_nvtx(True)``) and the ``nvtx`` package imports, so the launch path
pays one global read per range when no profiler is attached.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_DOMAIN = "asyncbatch"
_nvtx = None
_enabled = False


def enable_nvtx(on: bool = True) -> bool:
    """Turn ranges on or off; returns whether they are on (False if ``nvtx`` is missing)."""
    global _nvtx, _enabled
    if on and _nvtx is None:
        try:
            import nvtx as module
        except ImportError:
            module = None
        _nvtx = module
    _enabled = bool(on and _nvtx is not None)
    return _enabled


def nvtx_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def _range(name: str, step_id: int | None, detail: str) -> Iterator[None]:
    message = name if step_id is None else f"{name} step={step_id}{detail}"
    with _nvtx.annotate(message, domain=_DOMAIN):
        yield


_NULL = contextlib.nullcontext()


def mark(name: str, step_id: int | None = None, detail: str = ""):
    if not _enabled:
        return _NULL
    return _range(name, step_id, detail)


if os.environ.get("ASYNCBATCH_NVTX") == "1":
    enable_nvtx(True)
