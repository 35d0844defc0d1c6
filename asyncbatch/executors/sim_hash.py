"""The simulated device's hash: splitmix64's finaliser, for pseudo-tokens, output lengths and acceptances."""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic: array integer overflow never warns).

    In place on one fresh array, no ``errstate``: the sim's host time per step is mostly the fixed cost of
    each array operation, and a verify step calls this a dozen times."""
    x = np.add(x, _GOLDEN, dtype=np.uint64, casting="unsafe")
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x
