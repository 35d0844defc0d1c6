"""When requests arrive: a Poisson process, or a burstier gamma renewal process.

Follows vLLM's ``benchmark_serving``: inter-arrival gaps are gamma-distributed
with shape ``burstiness`` and mean ``1 / rate``. ``burstiness == 1`` is a Poisson
process (exponential gaps); smaller values give bursts separated by lulls,
larger values more regular arrivals. ``rate == inf`` submits everything at once.
Seeded, so every system sees the same arrival times.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``n`` requests arrives (first at 0, non-decreasing)."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` -> ``[1.0, 2.0, 4.0, inf]``."""
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be positive numbers or inf, got {text!r}")
    return rates
