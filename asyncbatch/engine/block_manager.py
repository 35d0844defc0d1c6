"""Paged KV cache accounting: free blocks, reference counts, and the block table of every token row.

KV blocks are listed by token rows (a running request's row in the device
token buffer, ``Request.token_row``). Row ``r`` lists ``block_table[r, :num_row_blocks[r]]``,
in order: block ``j`` of the row holds the keys and values of positions
``j * block_size .. (j + 1) * block_size - 1``. The table is written here, when
blocks are shared or allocated; the metadata writer only gathers it. Columns
past a row's block count hold stale ids of earlier rows; every reader is
bounded by the block count or the context length, so they are never used.

With prefix caching (``prefix_caching=True``; the engine's default, see
``EngineConfig.enable_prefix_caching``) full blocks are registered in a
``PrefixCache`` and may be listed by several rows at once: a row that reuses
a cached prefix lists the cached blocks first (``share``) and gets fresh
blocks for the rest. A row only ever writes into blocks it got fresh, past the
shared ones, so a shared block is read-only. ``ref[b]`` counts the held rows
listing block ``b``; a block whose count drops to 0 goes to the free stack, or,
if cached, stays cached as *evictable* until a fresh block is needed and none
is free (least recently released first).

``num_free_blocks`` counts what ``allocate`` can hand out: free plus evictable
blocks. After every request ended it equals ``num_usable_blocks`` with caching
on or off.

A row that gives its blocks back before its full blocks are registered may
*park* them (``park``): the row is empty at once, and a ``ParkedBlocks``
record keeps the references until ``unpark`` drops them, after the caller
registered them (``prefix_sharing``: registration is the costly part of a
release, done later within a time budget). Parked blocks count as held.

Invariant (``check_integrity``): every usable block is on the free stack, or
evictable, or held (``ref > 0``), exactly one of them; ``ref[b]`` equals the
number of held rows whose table prefix lists ``b`` (at most once per row) plus
the parked records listing it; the cache's table agrees with its records
(``PrefixCache.check``). Block 0 is the
dummy block: padding rows of a captured CUDA graph write their keys and values
there, so it is never handed out.

Freeing is stream-ordered, not fenced: a block freed (or evicted) while
planning step N+1 may be given to another request in step N+1 or later, and
the device runs steps in order, so the old owner's last use finishes before
the new owner's first write. The same order makes a block registered while
planning step N safe to read from step N+1 on (``docs/prefix-caching.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from asyncbatch.engine.prefix_cache import ROOT, CachedBlock, PrefixCache
from asyncbatch.engine.request import Request
from asyncbatch.engine.step_contract import DUMMY_BLOCK, blocks_for_tokens

__all__ = ["DUMMY_BLOCK", "BlockManager", "IntegrityError", "blocks_for_tokens"]  # the constants: step_contract


class IntegrityError(AssertionError):
    """Block or row accounting is inconsistent: a bug, never the user's fault."""


@dataclass(slots=True, eq=False)
class ParkedBlocks:
    """A released row's blocks, still referenced until ``BlockManager.unpark``: its table prefix and its chain
    (the serials of its registered blocks, extended when the rest are registered)."""

    blocks: np.ndarray  # [n] int64, in the row's order
    chain: list[int]


class BlockManager:
    """The free stack, the reference counts, the prefix cache, and for each of ``max_num_seqs`` token rows the
    blocks it lists.

    ``max_blocks_per_seq`` is the table's width: ``blocks_for_tokens(max_model_len, block_size)``.
    ``chains[row]`` names the cached content of the row's first full blocks: entry ``j`` is the serial of the
    ``CachedBlock`` whose tokens and prefix the row's block ``j`` holds (the row's own block, or an equal one
    registered first); it grows as the row's full blocks are registered and is empty for a row without blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int, *,
                 prefix_caching: bool = False) -> None:
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
        self.ref = np.zeros(num_blocks, dtype=np.int64)  # [num_blocks] held rows listing each block
        # Resident from the start, as ``RowState.history`` and for the same reason: no page faults in the
        # steps that admit new rows.
        self.block_table = np.full((max_num_seqs, max_blocks_per_seq), 0, dtype=np.int64)  # [S, B]
        self._table_flat = self.block_table.reshape(-1)  # [S * B] view
        self.num_row_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # [S]
        # Slot of position p, for p in the row's newest block: decode_slot_base[row] + p (one gather per
        # decode step instead of a division, a gather from the wide table and a modulo).
        self.decode_slot_base = np.zeros(max_num_seqs, dtype=np.int64)  # [S]
        self.prefix: PrefixCache | None = PrefixCache(num_blocks, block_size) if prefix_caching else None
        self.chains: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self._parked: dict[int, ParkedBlocks] = {}  # id(record) -> record
        self.num_parked_blocks = 0
        # Cached blocks taken out of the cache for the admission batch being decided (``evict_for_admission``),
        # in eviction order: its ``allocate_admitted`` pops them after the free stack. Empty between plans.
        self._evicted: list[int] = []
        # What ``share`` listed for the admission batch being decided, written with its ``allocate_admitted``: the
        # flat table slots and ids of the shared blocks, and the ids that were held already (their reference
        # counts rise then; evictable ones are reclaimed and counted at once). Empty between plans.
        self._shared_slots: list[int] = []
        self._shared_ids: list[int] = []
        self._shared_held: list[int] = []

    @property
    def caching(self) -> bool:
        return self.prefix is not None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: free, plus cached blocks no row holds (evicted when taken)."""
        return self._num_free + (self.prefix.num_evictable if self.prefix is not None else 0)

    @property
    def num_unused_blocks(self) -> int:
        """Blocks on the free stack: what ``allocate`` hands out before it evicts a cached block."""
        return self._num_free

    def free_blocks(self) -> list[int]:
        """The free stack, next block to hand out last (for tests and debugging; evictable blocks excluded)."""
        return self._free[:self._num_free].tolist()

    def _pop(self, k: int) -> np.ndarray:
        """The next ``k`` fresh blocks ([k] int64): off the free stack in the order k single pops would give
        them, then, if the stack runs out, the blocks ``evict_for_admission`` took out of the cache, then evicted
        cached blocks, least recently released first."""
        top, early = self._num_free, self._evicted
        if k > self.num_free_blocks + len(early):
            raise IntegrityError(f"allocate({k}) with {self.num_free_blocks} free: the scheduler must check first")
        if k <= top:
            self._num_free = top - k
            return self._free[top - k:top][::-1].copy()
        self._num_free = 0
        taken = early[:k - top]
        del early[:k - top]
        evicted = np.asarray(taken + self.prefix.evict(k - top - len(taken)), dtype=np.int64)
        return np.concatenate([self._free[:top][::-1], evicted])

    def evict_for_admission(self, k: int) -> None:
        """Take the ``k`` least recently released evictable blocks out of the cache now, for fresh blocks of the
        admission batch being decided (``Admitter.admit``) once the free stack cannot hold them: the cache lookups
        of the requests decided after it no longer find them, as if its blocks had been popped already; the
        batch's ``allocate_admitted`` hands them out after the free stack, in this order."""
        self._evicted += self.prefix.evict(k)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def extra_blocks_needed(self, row: int, num_tokens: int) -> int:
        """Blocks to add so ``row`` can hold ``num_tokens`` tokens of KV."""
        return max(0, self.blocks_for(num_tokens) - int(self.num_row_blocks[row]))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def share(self, row: int, cached: Sequence[CachedBlock], blocks: list[int], num_idle: int) -> None:
        """List ``cached`` (a verified chain from ``PrefixCache.match``; ``blocks`` their ids, ``num_idle`` of them
        evictable) as the first blocks of empty ``row``, which is being admitted: the evictable ones are reclaimed
        now (held, no longer free, so a later hit or eviction in the batch sees them taken); the row's table
        entries and the held ones' reference counts are written with the batch's ``allocate_admitted``, which
        also sets the row's block count. A burst that shares one prefix thus costs a few list appends a request."""
        k = len(cached)
        if not k:
            return
        if self.num_row_blocks[row]:
            raise IntegrityError(f"row {row} shares cached blocks after holding blocks of its own")
        ref = self.ref
        if num_idle:
            held = []
            for block in blocks:
                if ref[block] == 0:
                    self.prefix.reclaim(block)
                    ref[block] = 1
                else:
                    held.append(block)
        else:
            held = blocks
        base = row * self.max_blocks_per_seq
        self._shared_slots += range(base, base + k)
        self._shared_ids += blocks
        self._shared_held += held
        self.chains[row] = [rec.serial for rec in cached]

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
        self.ref[new] = 1

    def allocate_rows(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Give each of ``rows`` (distinct, [A] int64) ``counts[i]`` more blocks ([A] int64), rows in order: the
        blocks and table entries that ``allocate`` row by row would give, from one pop."""
        got = counts > 0  # [A]
        rows, counts = rows[got], counts[got]
        total = int(counts.sum())
        if not total:
            return
        grown = self.num_row_blocks[rows] + counts  # [A]
        if int(grown.max()) > self.max_blocks_per_seq:
            raise IntegrityError(f"a row needs {int(grown.max())} blocks, the table holds {self.max_blocks_per_seq}")
        lasts = np.cumsum(counts) - 1  # [A]
        self.allocate_admitted(rows, counts, grown, lasts, rows * self.max_blocks_per_seq + grown - 1 - lasts, total)

    def allocate_admitted(self, rows: np.ndarray, counts: np.ndarray, grown: np.ndarray, lasts: np.ndarray,
                          flat: np.ndarray, total: int) -> None:
        """``allocate_rows`` for an admission burst, with what its Python pass already knows: each of ``rows``
        ([A] int64, distinct) gets ``counts[i] >= 1`` blocks, ``total`` in all, to hold ``grown[i] <=
        max_blocks_per_seq``; its last is the ``lasts[i]``-th block popped (``cumsum(counts) - 1``), and the
        ``k``-th block popped goes to ``block_table.flat[k + flat[i]]`` (``flat = rows * max_blocks_per_seq +
        grown - 1 - lasts``). No reduction over the batch, so a burst pays for a few scatters."""
        if self._shared_slots:  # the batch's cache hits (``share``), listed first in their rows
            self._table_flat[self._shared_slots] = self._shared_ids
            np.add.at(self.ref, self._shared_held, 1)  # a block shared by several rows counts each
            self._shared_slots, self._shared_ids, self._shared_held = [], [], []
        new = self._pop(total)  # [N] rows[0]'s blocks first
        self._table_flat[np.arange(total, dtype=np.int64) + np.repeat(flat, counts)] = new
        self.num_row_blocks[rows] = grown
        self.decode_slot_base[rows] = (new[lasts] - (grown - 1)) * self.block_size
        self.ref[new] = 1

    def append_block(self, rows: np.ndarray) -> None:
        """Give each of ``rows`` (distinct, [G] int64) one more block, in order: the decode crossing path."""
        new = self._pop(len(rows))  # [G] rows[i] gets what the i-th pop would give
        counts = self.num_row_blocks[rows]  # [G]
        # A full row raises IndexError here; Scheduler.add refuses requests longer than the table.
        self.block_table[rows, counts] = new
        self.num_row_blocks[rows] = counts + 1
        self.decode_slot_base[rows] = (new - counts) * self.block_size
        self.ref[new] = 1

    def register(self, row: int, keys: Sequence[int], contents: Sequence[tuple[int, ...]], num_full: int,
                 root: tuple[int, int] = ROOT) -> None:
        """Register ``row``'s first ``num_full`` blocks as cached, past those already in its chain.

        The caller vouches that those blocks hold the KV of ``contents`` (token tuples known on the host) and
        that the step writing the last of them is planned; ``keys`` are their chain keys (``chain_keys``, from
        ``root``: the request's, ``prefix_cache.salted_root``). A block whose content is cached already stays
        uncached (the chain takes the existing record); a key owned by other content (a collision) stops the chain.
        """
        self._register_listed(f"row {row}", self.block_table[row, :self.num_row_blocks[row]], self.chains[row],
                              keys, contents, num_full, root)

    def register_rows(self, rows: np.ndarray, requests: Sequence[Request], num_full: np.ndarray) -> None:
        """``register`` for each of ``rows`` ([Q] int64) with its request's chain keys and token tuples
        (``Request.block_keys``/``block_contents``) up to ``num_full[i]`` blocks; rows whose chain is that long
        already are skipped (a prefill chunk that filled no block)."""
        chains = self.chains
        have = np.fromiter((len(chains[row]) for row in rows.tolist()), dtype=np.int64, count=len(rows))  # [Q]
        todo = (num_full > have).nonzero()[0]
        if not len(todo):
            return
        if (num_full[todo] > self.num_row_blocks[rows[todo]]).any():
            raise IntegrityError("a row registers more blocks than it lists")
        widest = int(num_full[todo].max())
        ids = self.block_table[rows[todo], :widest].tolist()  # one conversion instead of a scalar read per block
        held, upto = rows[todo].tolist(), num_full[todo].tolist()
        self.prefix.register_chains((chains[row], block_ids, request.block_keys, request.block_contents, n,
                                     request.cache_root)
                                    for row, block_ids, request, n in zip(held, ids, map(requests.__getitem__,
                                                                                         todo.tolist()), upto))

    def free(self, row: int) -> None:
        """Drop ``row``'s references to its blocks; a second call frees nothing."""
        n = int(self.num_row_blocks[row])
        if n == 0:
            return
        self._drop(self.block_table[row, :n], f"row {row}")
        self.num_row_blocks[row] = 0
        self.chains[row] = []

    def free_many(self, rows: list[int]) -> None:
        """``free`` for each of ``rows`` (distinct) in this order, with one pass of array operations for all:
        the same reference counts, free stack and LRU order. A finishing wave frees hundreds of rows in one
        step, and ``free``'s fixed cost (a dozen small array operations) per row was most of its release."""
        if not rows:
            return
        index = np.asarray(rows, dtype=np.int64)  # [R]
        counts = self.num_row_blocks[index]  # [R]
        width = int(counts.max())
        if width == 0:
            return
        # Each row's blocks last first, rows in order: the order ``free``'s drops, one row after another, use.
        backwards = counts[:, None] - 1 - np.arange(width)  # [R, W] column of the j-th block from the end
        listed = backwards >= 0  # [R, W]
        order = self.block_table[index[:, None], np.maximum(backwards, 0)][listed]  # [N]
        self._drop_in_order(order, lambda: f"rows {rows}", distinct=False)
        self.num_row_blocks[index] = 0
        chains = self.chains
        for row in rows:
            chains[row] = []

    def park(self, row: int) -> ParkedBlocks:
        """Empty ``row`` at once, its blocks keeping their references in the returned record until ``unpark``."""
        n = int(self.num_row_blocks[row])
        self.num_row_blocks[row] = 0
        return self._park_record(row, self.block_table[row, :n].copy())

    def park_many(self, rows: list[int]) -> list[ParkedBlocks]:
        """``park`` for each of ``rows`` (distinct), their tables copied in one gather. (``park`` stays apart:
        one request ending on EOS parks alone, and this gather costs it three times as much.)"""
        index = np.asarray(rows, dtype=np.int64)  # [R]
        counts = self.num_row_blocks[index].tolist()
        table = self.block_table[index, :max(counts)]  # [R, W] a copy (advanced indexing): rows change hands
        self.num_row_blocks[index] = 0
        return [self._park_record(row, table[i, :n]) for i, (row, n) in enumerate(zip(rows, counts))]

    def _park_record(self, row: int, blocks: np.ndarray) -> ParkedBlocks:
        """Move ``row``'s chain and its (copied) ``blocks`` into a parked record."""
        parked = ParkedBlocks(blocks, self.chains[row])
        self.chains[row] = []
        self._parked[id(parked)] = parked
        self.num_parked_blocks += len(blocks)
        return parked

    def unpark(self, parked: ParkedBlocks) -> None:
        """Drop a parked record's references, as ``free`` drops a row's."""
        del self._parked[id(parked)]
        self.num_parked_blocks -= len(parked.blocks)
        self._drop(parked.blocks, "a parked record")

    def register_parked(self, parked: ParkedBlocks, keys: Sequence[int], contents: Sequence[tuple[int, ...]],
                        num_full: int, root: tuple[int, int] = ROOT) -> None:
        """``register`` for a parked record's first ``num_full`` blocks."""
        self._register_listed("a parked record", parked.blocks, parked.chain, keys, contents, num_full, root)

    def _register_listed(self, holder: str, listed: np.ndarray, chain: list[int], keys: Sequence[int],
                         contents: Sequence[tuple[int, ...]], num_full: int, root: tuple[int, int]) -> None:
        """``register`` for a holder (a row, or a parked record) listing ``listed`` ([n] block ids) with
        ``chain``."""
        if num_full > len(listed):
            raise IntegrityError(f"{holder} registers {num_full} blocks but lists {len(listed)}")
        if num_full > len(chain):
            self.prefix.register_chains([(chain, listed[:num_full].tolist(), keys, contents, num_full, root)])

    def _drop(self, blocks: np.ndarray, holder: str) -> None:
        """One reference fewer to each of ``blocks`` ([n], a holder's list in order); blocks nobody holds any more
        go to the free stack or, if cached, to the evictable LRU, the holder's last block first."""
        self._drop_in_order(blocks[::-1], lambda: holder, distinct=True)

    def _drop_in_order(self, order: np.ndarray, holder: Callable[[], str], distinct: bool) -> None:
        """One reference fewer for each entry of ``order`` ([n]: one or more holders' blocks, in the order they
        are dropped); a block nobody holds any more goes to the free stack or, if cached, to the evictable LRU,
        at its last entry. ``distinct``: no block appears twice (one holder). ``holder()`` names the holders
        (called only for the error: a wave's row list is long)."""
        ref = self.ref
        if distinct:
            if (ref[order] <= 0).any():
                raise IntegrityError(f"{holder()} frees blocks no row holds")
            ref[order] -= 1
            idle = order[ref[order] == 0]  # [I]
        else:
            # Blocks shared by several of the holders: each loses one reference per entry, and goes idle at
            # the entry that drops its last (the last one: the holders drop in this order).
            ids, last_from_end, times = np.unique(order[::-1], return_index=True, return_counts=True)  # [U]
            if (ref[ids] < times).any():
                raise IntegrityError(f"{holder()} free blocks no row holds")
            ref[ids] -= times
            last = np.sort(len(order) - 1 - last_from_end[ref[ids] == 0])  # [I] entries, in order
            idle = order[last]
        if self.prefix is not None:
            cached = self.prefix.cached[idle]  # [I]
            if cached.any():
                # Newest blocks first into the LRU: a block is worthless without its parent, so it goes first.
                self.prefix.release(idle[cached].tolist())
                idle = idle[~cached]
        top = self._num_free
        self._free[top:top + len(idle)] = idle
        self._num_free = top + len(idle)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block no row holds; True if nothing stays cached (no held block was)."""
        if self.prefix is None:
            return True
        dropped = np.asarray(self.prefix.drop_evictable(), dtype=np.int64)[::-1]
        top = self._num_free
        self._free[top:top + len(dropped)] = dropped
        self._num_free = top + len(dropped)
        self.prefix.reset_counters()
        return self.prefix.num_cached == 0

    def check_integrity(self, held_rows: np.ndarray) -> None:
        """Raise ``IntegrityError`` unless free, evictable and held blocks partition the usable blocks, every
        reference count matches the held rows' tables, and the prefix cache agrees with itself."""
        if self._evicted or self._shared_slots:
            raise IntegrityError("blocks evicted or shared for an admission batch were never allocated")
        free = self._free[:self._num_free]  # [F]
        if len(np.unique(free)) != len(free):
            raise IntegrityError("a block is on the free list twice")
        if (free == DUMMY_BLOCK).any():
            raise IntegrityError("the dummy block is on the free list")
        unheld = np.ones(self.max_num_seqs, dtype=bool)
        unheld[held_rows] = False
        if self.num_row_blocks[unheld].any():
            raise IntegrityError("a row that no request holds lists blocks")
        if any(self.chains[row] for row in np.flatnonzero(unheld).tolist()):
            raise IntegrityError("a row that no request holds has a cache chain")
        counts = self.num_row_blocks[held_rows]  # [H]
        in_prefix = np.arange(self.max_blocks_per_seq) < counts[:, None]  # [H, B]
        listed = self.block_table[held_rows][in_prefix]  # [sum(counts)]
        owners = np.repeat(held_rows, counts)  # [sum(counts)]
        if (listed == DUMMY_BLOCK).any():
            raise IntegrityError("a row lists the dummy block")
        if len(np.unique(listed * self.max_num_seqs + owners)) != len(listed):
            raise IntegrityError("a row lists a block twice")
        listings = np.bincount(listed, minlength=self.num_blocks)  # [num_blocks]
        for parked in self._parked.values():
            if len(np.unique(parked.blocks)) != len(parked.blocks) or (parked.blocks == DUMMY_BLOCK).any():
                raise IntegrityError("a parked record lists a block twice, or the dummy block")
            listings[parked.blocks] += 1
        if sum(len(p.blocks) for p in self._parked.values()) != self.num_parked_blocks:
            raise IntegrityError("the parked block count differs from the parked records")
        if not np.array_equal(listings, self.ref):
            bad = np.flatnonzero(listings != self.ref)[:5]
            raise IntegrityError(f"blocks {bad.tolist()} have reference counts {self.ref[bad].tolist()} but are "
                                 f"listed by {listings[bad].tolist()} rows")
        evictable = np.zeros(0, dtype=np.int64)
        if self.prefix is not None:
            self.prefix.check(self.ref, IntegrityError)
            evictable = np.asarray(self.prefix.evictable_blocks(), dtype=np.int64)
            if self.prefix.cached[free].any():
                raise IntegrityError("a block on the free list is still cached")
            self._check_chains(held_rows)
        seen = np.zeros(self.num_blocks, dtype=np.int64)
        seen[free] += 1
        seen[evictable] += 1
        seen += self.ref > 0
        if (seen[1:] != 1).any():
            bad = np.nonzero(seen[1:] != 1)[0][:5] + 1
            raise IntegrityError(f"blocks {bad.tolist()} are free, evictable or held {seen[bad].tolist()} times "
                                 "(expected exactly one)")

    def _check_chains(self, held_rows: np.ndarray) -> None:
        for row in held_rows.tolist():
            chain = self.chains[row]
            if len(chain) > self.num_row_blocks[row]:
                raise IntegrityError(f"row {row} names more cached blocks than it lists")
            for j, serial in enumerate(chain):
                rec = self.prefix.record(int(self.block_table[row, j]))
                if rec is not None and rec.serial != serial:
                    raise IntegrityError(f"row {row}'s block {j} is cached as other content than its chain names")
