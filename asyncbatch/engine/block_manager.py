"""Paged KV cache accounting: a free list of fixed-size blocks and who owns each.

Invariant (``check_integrity``): every usable block is either on the free list
or owned by exactly one live request, and a request owns exactly the blocks on
its ``block_ids`` list. Block 0 is the dummy block: padding rows of a captured
CUDA graph write their keys and values there, so it is never handed out.

Freeing is stream-ordered, not fenced: a block freed while planning step N+1
may be given to another request in step N+1 or later, and the device runs
steps in order, so the old owner's last use finishes before the new owner's
first write.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from asyncbatch.engine.request import Request

DUMMY_BLOCK = 0
_FREE = -1  # owner id of a block on the free list


class IntegrityError(AssertionError):
    """Block accounting is inconsistent: a bug, never the user's fault."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is the dummy block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: low block ids go out first, which keeps traces readable.
        self._free: list[int] = list(range(num_blocks - 1, DUMMY_BLOCK, -1))
        self._owner = np.full(num_blocks, _FREE, dtype=np.int64)  # arrival_seq of the owner
        self._owner[DUMMY_BLOCK] = _FREE

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks to add so ``request`` can hold ``num_tokens`` tokens of KV."""
        return max(0, self.blocks_for(num_tokens) - len(request.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> list[int]:
        """Grow ``request``'s blocks to cover ``num_tokens``; returns the new block ids."""
        need = self.extra_blocks_needed(request, num_tokens)
        if need == 0:
            return []
        if need > len(self._free):
            raise IntegrityError(f"allocate({need}) with {len(self._free)} free: the scheduler must check first")
        new = [self._free.pop() for _ in range(need)]
        self._owner[new] = request.arrival_seq
        request.block_ids.extend(new)
        return new

    def free(self, request: Request) -> int:
        """Return every block of ``request`` to the free list; a second call frees nothing."""
        blocks = request.block_ids
        if not blocks:
            return 0
        owners = self._owner[blocks]
        if (owners != request.arrival_seq).any():
            raise IntegrityError(f"request {request.request_id} frees blocks it does not own")
        self._owner[blocks] = _FREE
        self._free.extend(reversed(blocks))
        request.block_ids = []
        return len(blocks)

    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """Raise ``IntegrityError`` unless free list and owners partition the usable blocks."""
        free = self._free
        if len(set(free)) != len(free):
            raise IntegrityError("a block is on the free list twice")
        if DUMMY_BLOCK in free:
            raise IntegrityError("the dummy block is on the free list")
        seen = np.zeros(self.num_blocks, dtype=np.int64)
        seen[free] += 1
        if (self._owner[free] != _FREE).any():
            raise IntegrityError("a free block has an owner")
        for request in live_requests:
            blocks = request.block_ids
            if not blocks:
                continue
            seen[blocks] += 1
            if (self._owner[blocks] != request.arrival_seq).any():
                raise IntegrityError(f"request {request.request_id} lists blocks owned by another")
            if request.finished:
                raise IntegrityError(f"finished request {request.request_id} still holds blocks")
        if (seen[1:] != 1).any():
            bad = np.nonzero(seen[1:] != 1)[0][:5] + 1
            raise IntegrityError(f"blocks {bad.tolist()} are owned {seen[bad].tolist()} times (expected once)")
