"""Synthetic request sets shared by the demo and the benchmark scripts.

Prompts are random token ids drawn from the ordinary (non-special) part of the
vocabulary; lengths follow the named distribution. Seeded, so every system in a
comparison gets the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


def uniform_requests(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                     seed: int = 0, first_token_id: int = 256) -> list[WorkItem]:
    """``n`` requests with prompt and output lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        plen = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        olen = int(rng.integers(output_range[0], output_range[1] + 1))
        ids = rng.integers(first_token_id, vocab_size, size=plen).tolist()
        items.append(WorkItem(ids, olen))
    return items
