"""Batch-size buckets: which padded sizes get a graph, and which one a step uses.

A decode step of ``rows`` rows replays the graph of the smallest bucket
``>= rows``; the rows in between are padding. A step larger than the largest
bucket has no graph and runs eagerly. The default list is dense where small
batches are common and padding would cost most, relatively:

    1, 2, 4, 8, 16, 24, ..., 256 (every 8), 272, 288, ... (every 16), max_num_seqs

so a step pads at most 7 rows up to 256 and at most 15 beyond.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

_SMALL = (1, 2, 4, 8)
_STEP_UP_TO_256 = 8
_STEP_BEYOND_256 = 16


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The default buckets for an engine that runs at most ``max_num_seqs`` rows per step.

    The largest bucket is ``max_num_seqs`` itself, so every decode step fits a graph.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [*_SMALL, *range(16, 257, _STEP_UP_TO_256), *range(256 + _STEP_BEYOND_256, max_num_seqs + 1,
                                                                 _STEP_BEYOND_256)]
    sizes = [s for s in sizes if s < max_num_seqs]
    return (*sizes, max_num_seqs)


def normalize_batch_sizes(sizes: Iterable[int] | None, max_num_seqs: int) -> tuple[int, ...]:
    """Sorted, unique buckets from a user's list (``None``: the defaults).

    A size above ``max_num_seqs`` becomes ``max_num_seqs``: a larger graph could
    never be filled. Steps above the largest size given run eagerly.
    """
    if sizes is None:
        return default_batch_sizes(max_num_seqs)
    result = set()
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"batch sizes must be positive ints, got {size!r}")
        result.add(min(size, max_num_seqs))
    if not result:
        raise ValueError("batch sizes must not be empty (disable CUDA graphs instead)")
    return tuple(sorted(result))


def choose_bucket(sizes: Sequence[int], rows: int) -> int | None:
    """The smallest of the sorted ``sizes`` that holds ``rows`` rows, or None if none does."""
    if rows < 1:
        raise ValueError(f"a step has at least one row, got {rows}")
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None
