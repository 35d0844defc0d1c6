"""Paged KV cache accounting: a free list of fixed-size blocks and the block table of every token row.

KV blocks belong to token rows (a running request's row in the device token
buffer, ``Request.token_row``). Row ``r`` owns ``block_table[r, :num_row_blocks[r]]``,
in order: block ``j`` of the row holds the keys and values of positions
``j * block_size .. (j + 1) * block_size - 1``. The table is written once, here,
when blocks are allocated; the metadata writer only gathers it. Columns past a
row's block count hold stale ids of earlier owners; every reader is bounded by
the block count or the context length, so they are never used.

Invariant (``check_integrity``): every usable block is either on the free list
or in the table prefix of exactly one held row, and ``_owner`` names that row.
Block 0 is the dummy block: padding rows of a captured CUDA graph write their
keys and values there, so it is never handed out.

Freeing is stream-ordered, not fenced: a block freed while planning step N+1
may be given to another request in step N+1 or later, and the device runs
steps in order, so the old owner's last use finishes before the new owner's
first write.
"""

from __future__ import annotations

import numpy as np

DUMMY_BLOCK = 0
NO_ROW = -1  # owner of a block on the free list (and of the dummy block)


class IntegrityError(AssertionError):
    """Block or row accounting is inconsistent: a bug, never the user's fault."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: the one ceiling division of the project."""
    return -(-num_tokens // block_size)


class BlockManager:
    """The free list, and for each of ``max_num_seqs`` token rows the blocks it owns.

    ``max_blocks_per_seq`` is the table's width: ``blocks_for_tokens(max_model_len, block_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is the dummy block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # A stack popped from the end (low block ids go out first, which keeps traces readable), held in an
        # array so that handing out or taking back many blocks is one slice.
        self._free = np.arange(num_blocks - 1, DUMMY_BLOCK, -1, dtype=np.int64)  # [num_blocks - 1]
        self._num_free = num_blocks - 1
        self._owner = np.full(num_blocks, NO_ROW, dtype=np.int64)  # [num_blocks] token row holding each block
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int64)  # [S, B]
        self.num_row_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # [S]
        # Slot of position p, for p in the row's newest block: decode_slot_base[row] + p (one gather per
        # decode step instead of a division, a gather from the wide table and a modulo).
        self.decode_slot_base = np.zeros(max_num_seqs, dtype=np.int64)  # [S]

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def free_blocks(self) -> list[int]:
        """The free list, next block to hand out last (for tests and debugging)."""
        return self._free[:self._num_free].tolist()

    def _pop(self, k: int) -> np.ndarray:
        """The next ``k`` free blocks, in the order k single pops would give them ([k] int64)."""
        top = self._num_free
        if k > top:
            raise IntegrityError(f"allocate({k}) with {top} free: the scheduler must check first")
        self._num_free = top - k
        return self._free[top - k:top][::-1].copy()

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def extra_blocks_needed(self, row: int, num_tokens: int) -> int:
        """Blocks to add so ``row`` can hold ``num_tokens`` tokens of KV."""
        return max(0, self.blocks_for(num_tokens) - int(self.num_row_blocks[row]))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._num_free

    def allocate(self, row: int, num_tokens: int) -> None:
        """Grow ``row``'s blocks to cover ``num_tokens`` tokens."""
        have = int(self.num_row_blocks[row])
        need = self.blocks_for(num_tokens) - have
        if need <= 0:
            return
        if have + need > self.max_blocks_per_seq:
            raise IntegrityError(f"row {row} needs {have + need} blocks, the table holds {self.max_blocks_per_seq}")
        new = self._pop(need)  # [need]
        self.block_table[row, have:have + need] = new
        self.num_row_blocks[row] = have + need
        self.decode_slot_base[row] = (new[-1] - (have + need - 1)) * self.block_size
        self._owner[new] = row

    def append_block(self, rows: np.ndarray) -> None:
        """Give each of ``rows`` (distinct, [G] int64) one more block, in order: the decode crossing path."""
        new = self._pop(len(rows))  # [G] rows[i] gets what the i-th pop would give
        counts = self.num_row_blocks[rows]  # [G]
        # A full row raises IndexError here; Scheduler.add refuses requests longer than the table.
        self.block_table[rows, counts] = new
        self.num_row_blocks[rows] = counts + 1
        self.decode_slot_base[rows] = (new - counts) * self.block_size
        self._owner[new] = rows

    def free(self, row: int) -> None:
        """Return every block of ``row`` to the free list; a second call frees nothing."""
        n = int(self.num_row_blocks[row])
        if n == 0:
            return
        blocks = self.block_table[row, :n]  # [n]
        if (self._owner[blocks] != row).any():
            raise IntegrityError(f"row {row} frees blocks it does not own")
        self._owner[blocks] = NO_ROW
        top = self._num_free
        self._free[top:top + n] = blocks[::-1]
        self._num_free = top + n
        self.num_row_blocks[row] = 0

    def check_integrity(self, held_rows: np.ndarray) -> None:
        """Raise ``IntegrityError`` unless the free list and the held rows' tables partition the usable blocks."""
        free = self._free[:self._num_free]  # [F]
        if len(np.unique(free)) != len(free):
            raise IntegrityError("a block is on the free list twice")
        if (free == DUMMY_BLOCK).any():
            raise IntegrityError("the dummy block is on the free list")
        if (self._owner[free] != NO_ROW).any():
            raise IntegrityError("a free block has an owner")
        unheld = np.ones(self.max_num_seqs, dtype=bool)
        unheld[held_rows] = False
        if self.num_row_blocks[unheld].any():
            raise IntegrityError("a row that no request holds owns blocks")
        counts = self.num_row_blocks[held_rows]  # [H]
        in_prefix = np.arange(self.max_blocks_per_seq) < counts[:, None]  # [H, B]
        owned = self.block_table[held_rows][in_prefix]  # [sum(counts)]
        owners = np.repeat(held_rows, counts)  # [sum(counts)]
        if (owned == DUMMY_BLOCK).any():
            raise IntegrityError("a row holds the dummy block")
        if (self._owner[owned] != owners).any():
            raise IntegrityError("a row lists blocks owned by another")
        seen = np.zeros(self.num_blocks, dtype=np.int64)
        seen[free] += 1
        np.add.at(seen, owned, 1)
        if (seen[1:] != 1).any():
            bad = np.nonzero(seen[1:] != 1)[0][:5] + 1
            raise IntegrityError(f"blocks {bad.tolist()} are owned {seen[bad].tolist()} times (expected once)")
