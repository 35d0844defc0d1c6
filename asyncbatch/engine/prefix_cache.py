"""Content-addressed full KV blocks: the key chain, the table of cached blocks, and their LRU order.

A *full* block holds the keys and values of ``block_size`` consecutive tokens
at positions ``j * block_size ..`` of some sequence. Those keys and values are
a function of every token up to the block's end, so a block is named by its
tokens chained with its parent's name::

    key[j] = hash((key[j - 1], tuple(tokens[j * bs:(j + 1) * bs])))      key[-1] = ROOT_KEY

Equal tokens at different positions, or after different prefixes, get
different keys. A request with a ``cache_salt`` (vLLM's field: one tenant's
prompts never hit another's cache) starts its chain at a root of its own
(``salted_root``): its own root key, and a root serial that its first block's
record must name, so even equal tokens under two salts share nothing.

The hash is Python's own ``hash`` of a tuple of ints: ints
and tuples of ints hash the same in every process of one CPython build (only
``str``/``bytes`` hashing is salted), it costs about a microsecond per block,
and it needs no serialisation (``hashlib`` would need the tokens as bytes first,
and would still be a 2**-64-ish bet unless verified). Instead of trusting the
hash, a lookup *verifies* every block it returns: the cached block's tokens
must equal the request's, and its recorded parent must be the very record
matched one block earlier (``CachedBlock.parent_serial``; serials are never
reused). By induction a returned chain holds exactly the request's prefix; a
64-bit collision can only cost a cache hit (the second content is not
registered), never give wrong tokens.

Block states, with ``ref`` = how many held token rows list the block
(``BlockManager`` keeps the counts; this class keeps the table)::

    free        ref 0, not cached         on the BlockManager's free stack
    evictable   ref 0, cached             here, in LRU order; reused on a hit, evicted when a fresh block is needed
    held        ref > 0, cached or not    in the block tables of ``ref`` rows

Invariants (``check``): ``_by_key`` and ``_by_block`` hold the same records;
every record's key is the hash of its parent key and tokens; ``cached[b]``
iff block ``b`` has a record; the LRU holds exactly the cached blocks with
``ref == 0``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, KeysView, Sequence
from dataclasses import dataclass

import numpy as np

ROOT_KEY = 0x2545F4914F6CDD1D  # parent key of a sequence's first block (any fixed int; not salted per process)
ROOT_SERIAL = 0  # parent serial of a first block; records get serials from 1
ROOT = (ROOT_KEY, ROOT_SERIAL)  # the root of every chain without a cache salt


def salted_root(salt: str | None) -> tuple[int, int]:
    """``(root key, root serial)`` of the chains of requests with ``cache_salt`` ``salt`` (``ROOT`` for None): the
    salt's 64-bit BLAKE2b digest ``d`` gives the key ``hash((ROOT_KEY, d))`` and the serial ``-(d | 1)``, below every
    record's serial, so a first block registered under one salt is never verified under another (two salts share a
    root only if their 63-bit digests collide)."""
    if salt is None:
        return ROOT
    digest = int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")
    return hash((ROOT_KEY, digest)), -(digest | 1)


def chain_keys(tokens: Sequence[int], block_size: int, keys: list[int], contents: list[tuple[int, ...]],
               root: int = ROOT_KEY) -> None:
    """Extend ``keys`` and ``contents`` (the keys and token tuples of the first ``len(keys)`` full blocks of
    ``tokens``) to every full block of ``tokens``, in place; ``root`` is the first block's parent key (a salted
    request's own, ``salted_root``). Only new blocks are hashed, so a sequence that grows is hashed once; the
    tuples are kept for verifying lookups and registering blocks."""
    chain_tail(tokens[len(keys) * block_size:], block_size, keys, contents, root)


def chain_tail(tail: Sequence[int], block_size: int, keys: list[int], contents: list[tuple[int, ...]],
               root: int = ROOT_KEY) -> None:
    """``chain_keys`` given only the tokens after the blocks already in ``keys`` (``tail[0]`` is the first token
    of block ``len(keys)``): a growing sequence need not be rebuilt to extend its keys."""
    it = iter(tail[:len(tail) // block_size * block_size])
    new = list(zip(*[it] * block_size))  # the full blocks as tuples, built in C
    parent = keys[-1] if keys else root
    append = keys.append
    for content in new:
        parent = hash((parent, content))
        append(parent)
    contents.extend(new)


@dataclass(slots=True)
class CachedBlock:
    """What a cached block holds: the KV of ``tokens`` after the prefix that record ``parent_serial`` names."""

    block: int
    key: int
    parent_key: int
    tokens: tuple[int, ...]
    serial: int  # unique over the cache's life: names this content
    parent_serial: int  # the record of the preceding block at registration (a root serial for a first block)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since the start or the last ``reset_counters``."""

    prompt_tokens: int = 0  # tokens to prefill at admissions (a recompute counts its prompt and outputs)
    cached_tokens: int = 0  # of those, reused from the cache instead of computed
    evictions: int = 0  # cached blocks given out as fresh blocks
    # Requests that waited a step for blocks a chunk of the plan computed (``PrefixSharer.computing``), counted
    # once per plan they waited through: they then reused them instead of computing them again.
    deferred_admissions: int = 0


class PrefixCache:
    """The key -> block table of one ``BlockManager``, and the LRU order of its evictable blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._by_key: dict[int, CachedBlock] = {}
        self._by_block: list[CachedBlock | None] = [None] * num_blocks
        self.cached = np.zeros(num_blocks, dtype=bool)  # [num_blocks] the block has a record
        # Cached blocks no row holds, least recently released first: the eviction order.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._next_serial = ROOT_SERIAL + 1
        self.stats = PrefixCacheStats()

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def record(self, block: int) -> CachedBlock | None:
        return self._by_block[block]

    # -- lookups and registration ----------------------------------------------------------
    @property
    def chain_keys(self) -> KeysView[int]:
        """The keys of the cached records, a live read-only view (``key in chain_keys`` is ``holds(key)``)."""
        return self._by_key.keys()

    def holds(self, key: int) -> bool:
        """Whether a record has chain key ``key`` (a run of cached blocks can only start at such a key)."""
        return key in self._by_key

    def match(self, keys: Sequence[int], contents: Sequence[tuple[int, ...]], limit: int,
              root_serial: int = ROOT_SERIAL) -> list[CachedBlock]:
        """The cached records of the longest run of the first ``limit`` full blocks with these keys and token
        tuples (``chain_keys``), each verified against its tokens and the record before it (the first against
        ``root_serial``, the request's chain root)."""
        found: list[CachedBlock] = []
        parent = root_serial
        by_key = self._by_key
        for j in range(limit):
            rec = by_key.get(keys[j])
            if rec is None or rec.parent_serial != parent or rec.tokens != contents[j]:
                break
            found.append(rec)
            parent = rec.serial
        return found

    def register_chains(self, chains: Iterable[tuple[list[int], Sequence[int], Sequence[int],
                                                      Sequence[tuple[int, ...]], int, tuple[int, int]]]) -> None:
        """Offer held blocks as the KV of their tokens, along the chains of several holders at once: for each
        ``(chain, block_ids, keys, contents, num_full, root)``, blocks ``len(chain) .. num_full - 1`` (``block_ids``,
        ``keys`` and ``contents`` indexed by block) after the prefix whose serials ``chain`` lists (``root``: the
        request's chain root, ``salted_root``). Each block's
        content gets a new record, or is cached already after the same prefix (that record names it and the block
        stays uncached); its serial is appended to ``chain``. A key that another content owns (a hash collision)
        ends that chain. One loop for a whole admission burst, the new blocks marked cached by one array write."""
        by_key, by_block = self._by_key, self._by_block
        serial = self._next_serial
        marked: list[int] = []
        for chain, block_ids, keys, contents, num_full, (root_key, root_serial) in chains:
            first = len(chain)
            parent_key = keys[first - 1] if first else root_key
            parent_serial = chain[-1] if first else root_serial
            for j in range(first, num_full):
                key, tokens = keys[j], contents[j]
                rec = by_key.get(key)
                if rec is None:
                    block = block_ids[j]
                    rec = CachedBlock(block, key, parent_key, tokens, serial, parent_serial)
                    serial += 1
                    by_key[key] = by_block[block] = rec
                    marked.append(block)
                elif rec.parent_serial != parent_serial or rec.tokens != tokens:
                    break  # a hash collision: the content first registered keeps the key
                chain.append(rec.serial)
                parent_key, parent_serial = key, rec.serial
        self._next_serial = serial
        if marked:
            self.cached[marked] = True

    # -- the LRU of evictable blocks --------------------------------------------------------
    def release(self, blocks: Sequence[int]) -> None:
        """Cached ``blocks`` that no row holds any more, evicted in this order after those released before."""
        for block in blocks:
            self._lru[block] = None

    def reclaim(self, block: int) -> None:
        """A row holds evictable ``block`` again (a cache hit)."""
        del self._lru[block]

    def evict(self, k: int) -> list[int]:
        """Take the ``k`` least recently released evictable blocks out of the cache (the caller holds them)."""
        out = []
        for _ in range(k):
            block, _ = self._lru.popitem(last=False)
            self._forget(block)
            out.append(block)
        self.stats.evictions += k
        return out

    def drop_evictable(self) -> list[int]:
        """Forget every evictable block (``reset_prefix_cache``); returns them, now plain free blocks."""
        out = list(self._lru)
        self._lru.clear()
        for block in out:
            self._forget(block)
        return out

    def _forget(self, block: int) -> None:
        rec = self._by_block[block]
        del self._by_key[rec.key]
        self._by_block[block] = None
        self.cached[block] = False

    def evictable_blocks(self) -> list[int]:
        return list(self._lru)

    def recent_keys(self, ref: np.ndarray, max_blocks: int) -> list[int]:
        """Keys of at most ``max_blocks`` cached blocks, the ones a new request is likeliest to hit first: held
        blocks (``ref > 0``, not evictable now), then evictable ones, most recently released first (the last
        to be evicted). What a replica publishes to a cache-aware router (``asyncbatch.cluster``)."""
        if max_blocks <= 0:
            return []
        held = np.flatnonzero(self.cached & (ref > 0))[:max_blocks]
        keys = [self._by_block[b].key for b in held.tolist()]
        if len(keys) < max_blocks:
            for block in reversed(self._lru):
                keys.append(self._by_block[block].key)
                if len(keys) == max_blocks:
                    break
        return keys

    def check(self, ref: np.ndarray, error: type[Exception]) -> None:
        """Raise ``error`` unless the table, the records and the LRU agree with each other and with ``ref``."""
        if len(self._by_key) != int(self.cached.sum()):
            raise error(f"{len(self._by_key)} keys for {int(self.cached.sum())} cached blocks")
        for key, rec in self._by_key.items():
            if rec.key != key or self._by_block[rec.block] is not rec or not self.cached[rec.block]:
                raise error(f"cached block {rec.block}: the key table and the block records disagree")
            if len(rec.tokens) != self.block_size or hash((rec.parent_key, rec.tokens)) != key:
                raise error(f"cached block {rec.block}: its key is not the hash of its parent key and tokens")
            if not rec.parent_serial < rec.serial < self._next_serial:  # a root serial is ROOT_SERIAL or negative
                raise error(f"cached block {rec.block}: its parent was registered after it")
        lru = np.fromiter(self._lru, dtype=np.int64, count=len(self._lru))
        expected = np.flatnonzero(self.cached & (ref == 0))
        if len(lru) != len(expected) or not np.array_equal(np.sort(lru), expected):
            raise error("the evictable blocks are not exactly the cached blocks no row holds")

    def reset_counters(self) -> None:
        self.stats = PrefixCacheStats()
