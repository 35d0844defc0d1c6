"""Prefix caching in the scheduler: what an admission reuses, and when computed blocks become cached.

Reuse. When a request is admitted (or re-admitted after a preemption) its
known tokens (prompt, plus the outputs to recompute) are hashed once into
chain keys (``Request.block_keys``) and the longest verified run of cached
full blocks is listed first in its row (``BlockManager.share``); its first
chunk starts after them. At most ``(prefill_len - 1) // block_size`` blocks
are reused, so the last prefill token is always computed and yields the
logits of the first output, even when the whole prompt is cached (the last
block is then computed again into a fresh block; a row never writes a shared
block).

Registration. A full block becomes cached only when (a) all its tokens are
known on the host and (b) the plan that writes its last position is final.
Steps run in launch order on one device queue (one CUDA stream, or the
device thread of ``cpu``/``sim``), so a block written by step N is complete
before any reader planned into step N+1 or later runs, even in overlap mode,
where step N may still be running while step N+1 is planned:

    planner  [plan N: A computes block b][launch N][b registered][plan N+1: B admitted, reuses b]
    device                                  [... step N: writes b ...][ step N+1: B reads b ]

Two moments satisfy (a) and (b):

- once the plan is final, for the blocks filled by its prefill chunks (prompt
  tokens, or a recompute's known outputs): ``register_planned``, called by
  ``Scheduler.release_drained`` (the core: after the launch, while the step
  runs) or else at the start of the next ``schedule``; not as each chunk is
  planned, which keeps requests admitted later in the same plan from reading a
  block the same step writes (such a request waits a step instead and then
  reuses the block: ``computing``, ``waits_for_computing``);
- when a request gives back its row (finish, abort, drain, preemption), for
  the blocks its decode steps filled: the outputs received so far are known,
  and every launched step that wrote them precedes any later reader. An
  output still in flight (overlap's one-step-late finish) is not known, so a
  block that needs it is not registered. Decode rows never hash anything
  while they run: planning a pure-decode step stays array work. The row is
  given back at once; its blocks are parked (held) and registered, then freed,
  by ``settle``: a slice per launched step while the step runs, before a plan
  that may admit a request reusing them (``settle_reusable``), or all at once
  when a plan may need them (``Scheduler.schedule``, the preemptor) or the
  engine goes idle. Registering later is as safe as registering at once: the
  tokens were copied at the release, and stream order still holds.

Stream order alone suffices for a block whose writer is preempted or aborted
before its step ran: the block stays cached (evictable), and a reader or a new
owner is planned into a later step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from asyncbatch.engine.block_manager import BlockManager, ParkedBlocks
from asyncbatch.engine.prefix_cache import CachedBlock, chain_keys, chain_tail
from asyncbatch.engine.request import Request
from asyncbatch.engine.row_state import RowState


class PrefixHit(NamedTuple):
    cached: list[CachedBlock]  # verified chain of cached blocks the request's row lists first
    blocks: list[int]  # their block ids
    num_tokens: int  # tokens they hold: the first chunk starts here
    num_reclaimed: int  # of them, evictable blocks (counted as free until shared)


NO_HIT = PrefixHit([], [], 0, 0)
_NONE = np.zeros(0, dtype=np.int64)


# Blocks ``PrefixSharer.settle`` registers between two looks at its ``stop``: ~20 us of a 2-core VM's planner (a
# 26-block, 400-token release took 64 us at the median, up to 0.7 ms cold), so a slice that starts just before the
# step it fills ends overruns it by that much, not by a whole release (profiles/speculative-intel-xeon-2core).
SETTLE_PIECE_BLOCKS = 8


@dataclass(slots=True)
class _PendingRelease:
    """A released request whose full blocks are registered by ``PrefixSharer.settle``, then freed."""

    request: Request
    parked: ParkedBlocks
    outputs: np.ndarray  # [O] int64 its outputs not yet hashed into ``request.block_keys``
    num_full: int  # its full blocks of known tokens that launched steps wrote
    registered: int = -1  # blocks offered to the cache so far (-1: its new blocks are not hashed yet)


class PrefixSharer:
    """Prefix reuse at admission and block registration for ``Scheduler`` (planner thread only).

    ``blocks`` and ``rows`` are the scheduler's own; the requests whose prefill chunk in the plan being built
    may fill blocks (``note_prefill``, registered by ``register_planned``) are this object's own state.
    """

    def __init__(self, blocks: BlockManager, rows: RowState) -> None:
        self.blocks = blocks
        self.rows = rows
        self._to_register: list[Request] = []  # prefilled in the plan being built (prefix caching)
        # Chain keys of the first block each prefill chunk of the plan being built completes (``note_computing``);
        # cleared by ``begin_plan``. A waiting request whose next block to reuse is among them waits a step.
        self.computing: set[int] = set()
        self._pending: deque[_PendingRelease] = deque()  # released, blocks parked until ``settle``, oldest first

    @staticmethod
    def _prefill_tokens(request: Request) -> list[int]:
        """The tokens a (re)admission prefills: the prompt, plus the outputs to recompute after a preemption."""
        return request.all_token_ids() if request.output_token_ids else request.prompt_token_ids

    def hit(self, request: Request, prefill_len: int) -> PrefixHit:
        """The cached blocks ``request`` would reuse if admitted now (nothing is taken yet)."""
        cache = self.blocks.prefix
        if cache is None:
            return NO_HIT
        bs, keys = self.blocks.block_size, request.block_keys
        # ``prefill_len`` is the length of ``_prefill_tokens``; the prompt's blocks were hashed on arrival, so only
        # outputs to recompute need hashing here (an admission burst skips building the token list).
        if len(keys) < prefill_len // bs:
            chain_keys(self._prefill_tokens(request), bs, keys, request.block_contents, request.cache_root[0])
        # A burst of distinct prompts misses at the first block: one lookup decides it, before any other check.
        if not keys or not cache.holds(keys[0]):
            return NO_HIT
        limit = (prefill_len - 1) // bs
        if not limit or (request.params.prompt_logprobs is not None and _scores_prompt(request)):
            return NO_HIT  # no full block before the last token; or its prompt is scored (registered once computed)
        cached = cache.match(keys, request.block_contents, limit, request.cache_root[1])
        if not cached:
            return NO_HIT
        ids = [rec.block for rec in cached]
        ref = self.blocks.ref
        # A few blocks a hit: scalar reads cost less than gathering them into an array and counting there.
        reclaimed = sum(1 for block in ids if ref[block] == 0)
        return PrefixHit(cached, ids, len(cached) * self.blocks.block_size, reclaimed)

    def begin_plan(self) -> None:
        """A new plan: no chunk of it computes anything yet."""
        self.computing.clear()

    def note_computing(self, request: Request, start: int, end: int) -> None:
        """``request``'s chunk ``[start, end)`` in the plan being built: if it completes the block holding
        ``start``, that block's key joins ``computing`` (the first block a request sharing this prefix would
        need next, having reused the cached ones before it)."""
        bs, keys = self.blocks.block_size, request.block_keys
        first = start // bs
        if end >= (first + 1) * bs and first < len(keys):
            self.computing.add(keys[first])

    def waits_for_computing(self, request: Request, prefill_len: int, num_hit_blocks: int) -> bool:
        """Whether ``request``, about to be admitted reusing ``num_hit_blocks`` cached blocks, should wait a step
        instead: the next block it could reuse is one a chunk of this plan computes (``computing``). Blocks
        become cached once the plan that computes them is final (module doc), so admitted now it would compute
        that block and the rest of the shared prefix again; a step later it reuses them. It must have such a
        block to reuse: one before its last prefill token, and no prompt of its own to score."""
        keys = request.block_keys
        return (num_hit_blocks < len(keys) and keys[num_hit_blocks] in self.computing
                and num_hit_blocks < (prefill_len - 1) // self.blocks.block_size and not _scores_prompt(request))

    def cached_keys(self) -> Collection[int]:
        """The chain keys the cache holds, live (``PrefixCache.chain_keys``): a prompt whose first block's key is
        not among them misses (``hit``'s first check), which admission decides without calling ``hit``."""
        return self.blocks.prefix.chain_keys

    def prepare(self, request: Request) -> None:
        """Hash ``request``'s prompt blocks (``Scheduler.add``, on arrival): admission then only looks them up."""
        if self.blocks.prefix is not None and not request.block_keys:
            chain_keys(request.prompt_token_ids, self.blocks.block_size, request.block_keys, request.block_contents,
                       request.cache_root[0])

    def share(self, row: int, hit: PrefixHit) -> None:
        """List ``hit``'s blocks first in ``row`` (just admitted, no blocks yet); its fresh blocks come after them
        (``BlockManager.allocate_admitted``)."""
        self.blocks.share(row, hit.cached, hit.blocks, hit.num_reclaimed)

    def count_admissions(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Admissions prefilling ``prompt_tokens`` tokens, ``cached_tokens`` of them reused (the hit rate)."""
        stats = self.blocks.prefix.stats
        stats.prompt_tokens += prompt_tokens
        stats.cached_tokens += cached_tokens

    def note_prefill(self, request: Request) -> None:
        """``request``'s chunk in the plan being built may fill blocks: register them when the plan is final."""
        if self.blocks.prefix is not None:
            self._to_register.append(request)

    def note_prefills(self, requests: list[Request]) -> None:
        """``note_prefill`` for each of ``requests``."""
        if self.blocks.prefix is not None:
            self._to_register.extend(requests)

    def register_planned(self) -> None:
        """End of ``schedule``: the full blocks this plan's prefill chunks wrote become cached."""
        if not self._to_register:
            return
        requests = self._to_register
        rows = np.fromiter((r.token_row for r in requests), dtype=np.int64, count=len(requests))  # [Q]
        self.blocks.register_rows(rows, requests, self.rows.num_computed[rows] // self.blocks.block_size)
        self._to_register.clear()

    def release(self, request: Request, row: int, park: bool) -> None:
        """``request`` gives back ``row``: its blocks are freed once the full blocks of known tokens its launched
        steps wrote are cached. ``park``: the row is empty at once and the blocks stay held (parked) until
        ``settle`` registers them; otherwise that happens now (a preemption needs the blocks now)."""
        blocks = self.blocks
        if blocks.prefix is None:
            blocks.free(row)
            return
        st, bs = self.rows, blocks.block_size
        num_outputs = int(st.num_outputs[row])
        prompt_len = len(request.prompt_token_ids)
        num_full = min(prompt_len + num_outputs, int(st.num_computed[row])) // bs
        if num_full <= len(blocks.chains[row]):
            blocks.free(row)
            return
        hashed = len(request.block_keys) * bs
        # The outputs after the hashed tokens, copied: the row's history belongs to its next owner.
        outputs = st.history[row, max(hashed - prompt_len, 0):num_outputs].copy() if hashed < num_full * bs else _NONE
        pending = _PendingRelease(request, blocks.park(row), outputs, num_full)
        if park:
            self._pending.append(pending)
        else:
            self._settle_one(pending)

    def release_many(self, requests: list[Request], rows: list[int], num_outputs: list[int]) -> None:
        """``release(request, row, park=True)`` for each of ``requests`` in order (``rows`` their rows,
        ``num_outputs`` the rows' output counts), with the row reads, the frees and the parks each done once
        for all of them."""
        blocks = self.blocks
        if blocks.prefix is None:
            blocks.free_many(rows)
            return
        st, bs, chains = self.rows, blocks.block_size, blocks.chains
        index = np.asarray(rows, dtype=np.int64)  # [R]
        freed: list[int] = []
        parks: list[tuple[Request, int, int, int, int]] = []  # (request, row, outputs from, outputs to, num_full)
        for request, row, outputs, computed in zip(requests, rows, num_outputs, st.num_computed[index].tolist()):
            prompt_len = len(request.prompt_token_ids)
            num_full = min(prompt_len + outputs, computed) // bs
            if num_full <= len(chains[row]):
                freed.append(row)
                continue
            hashed = len(request.block_keys) * bs
            parks.append((request, row, max(hashed - prompt_len, 0), outputs if hashed < num_full * bs else 0,
                          num_full))
        # Frees and parks are independent (a park keeps its blocks' references), so each group in order
        # leaves the free stack and the pending queue as the one-by-one releases would.
        blocks.free_many(freed)
        if not parks:
            return
        park_rows = [row for _, row, _, _, _ in parks]
        widest = max(end for _, _, _, end, _ in parks)
        # The outputs after the hashed tokens, copied in one gather: the rows' history belongs to their next owners.
        history = st.history[np.asarray(park_rows, dtype=np.int64), :widest]  # [P, widest]
        for i, ((request, _, start, end, num_full), parked) in enumerate(zip(parks, blocks.park_many(park_rows))):
            self._pending.append(_PendingRelease(request, parked, history[i, start:end] if end else _NONE, num_full))

    @property
    def num_pending(self) -> int:
        """Released requests whose blocks are parked until ``settle``."""
        return len(self._pending)

    def settle(self, budget_s: float | None = None, stop: Callable[[], bool] | None = None) -> int:
        """Register and free parked releases, oldest first. ``budget_s`` None: all of them. Otherwise in pieces of
        ``SETTLE_PIECE_BLOCKS`` blocks while ``stop()`` (asked before every piece, the first included) says no,
        until ``budget_s`` seconds have passed (one piece at least, when ``stop`` lets it start). Returns how many
        releases are left."""
        pending = self._pending
        if budget_s is None:
            while pending:
                self._settle_one(pending.popleft())
            return 0
        deadline = time.perf_counter() + budget_s
        while pending and (stop is None or not stop()):
            head = pending[0]
            if self._settle_piece(head, SETTLE_PIECE_BLOCKS):
                pending.popleft()
            if time.perf_counter() >= deadline:
                break
        return len(pending)

    def settle_reusable(self, waiting: Iterable[Request]) -> None:
        """Settle, now and whole, every parked release that one of ``waiting`` (the requests the next plan may
        admit) could reuse beyond what is cached: a release whose registered blocks end where a waiting request's
        hashed prompt blocks pass through (chained keys: an equal key is an equal prefix), so that its next
        blocks may be that release's outputs. A release with no block registered, or a waiting request with
        outputs to recompute (its keys past the prompt are not hashed yet), settles them all. Releases nobody
        can reuse stay parked for the slices: settling them here would put their registration on the path to
        the next launch at every arrival."""
        pending = self._pending
        if not pending:
            return
        tails: dict[int, list[_PendingRelease]] = {}
        for release in pending:
            n = len(release.parked.chain)
            if not n:
                self.settle()
                return
            tails.setdefault(release.request.block_keys[n - 1], []).append(release)
        reused: set[int] = set()
        for request in waiting:
            if request.num_outputs:
                self.settle()
                return
            reused.update(key for key in request.block_keys if key in tails)
        if not reused:
            return
        chosen = {id(release) for key in reused for release in tails[key]}
        self._pending = deque(release for release in pending if id(release) not in chosen)
        for release in pending:  # oldest first
            if id(release) in chosen:
                self._settle_one(release)

    def _settle_one(self, pending: _PendingRelease) -> None:
        self._settle_piece(pending, None)

    def _settle_piece(self, pending: _PendingRelease, max_blocks: int | None) -> bool:
        """Offer the next ``max_blocks`` (None: all) of ``pending``'s full blocks to the cache; once all are,
        free its blocks. Returns whether it is settled."""
        request = pending.request
        if pending.registered < 0:
            bs = self.blocks.block_size
            hashed = len(request.block_keys) * bs
            if hashed < pending.num_full * bs:  # hash the new blocks only: the tokens after the hashed ones
                tail = request.prompt_token_ids[hashed:] + pending.outputs.tolist()
                chain_tail(tail, bs, request.block_keys, request.block_contents, request.cache_root[0])
            pending.registered = len(pending.parked.chain)
        upto = pending.num_full if max_blocks is None else min(pending.registered + max_blocks, pending.num_full)
        self.blocks.register_parked(pending.parked, request.block_keys, request.block_contents, upto,
                                    request.cache_root)
        pending.registered = upto
        if upto < pending.num_full:
            return False
        self.blocks.unpark(pending.parked)
        return True

    # -- reporting -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Cumulative since the start or the last ``reset_prefix_cache``: prefilled and reused tokens at
        admissions (a recompute counts again), their ratio, blocks cached now, blocks evicted, and requests that
        waited a step for blocks the plan computed (``computing``; once per plan waited through)."""
        cache = self.blocks.prefix
        if cache is None:
            return {"enabled": False, "prompt_tokens": 0, "cached_tokens": 0, "hit_rate": 0.0, "cached_blocks": 0,
                    "evictions": 0, "deferred_admissions": 0}
        s = cache.stats
        return {"enabled": True, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                "hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "cached_blocks": cache.num_cached, "evictions": s.evictions,
                "deferred_admissions": s.deferred_admissions}

    def keys(self, max_blocks: int) -> list[int]:
        """Chain keys of up to ``max_blocks`` cached blocks (``PrefixCache.recent_keys``); empty without caching."""
        cache = self.blocks.prefix
        return [] if cache is None else cache.recent_keys(self.blocks.ref, int(max_blocks))

    def reset(self) -> bool:
        """Forget every cached block no running request lists and zero the counters; True if the cache is now
        empty (False: blocks that running requests list stay cached)."""
        return self.blocks.reset_prefix_cache()


def _scores_prompt(request: Request) -> bool:
    """A request that still has prompt logprobs to compute must compute its whole prompt (vLLM does the same):
    a cached prefix has no logits."""
    return request.params.prompt_logprobs is not None and request.prompt_logprobs_next < len(request.prompt_token_ids)
