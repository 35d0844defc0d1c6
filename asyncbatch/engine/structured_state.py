"""The engine core's grammar state: one matcher per live request with ``structured_outputs``, and one
``TokenConstraint`` per live request with ``allowed_token_ids`` or ``bad_words`` (``sampling.token_constraints``).

Everything here runs on the planner thread, except compiling, which runs on a
worker thread so a new schema never delays a launch. Where the host work meets
the overlap loop (``EngineCore.overlap_loop``):

    planner  [launch N+1 (forward only waits for nothing)][wait N][apply N: advance matchers][fill masks N+1]
    device   [ step N ...............][ forward N+1 ...........................][sample N+1]
                                                                       mask ready ^ (only grammar rows wait)

* ``advance`` feeds every kept token to its request's matcher, in step order,
  so a matcher is always in the state after the newest applied token;
* ``fill`` writes a step's masks only once every earlier step was applied
  (the planner calls it then), so the mask of step N+1 sees token N;
* a row whose request ended since the plan (its late token is dropped) gets
  an all-allowed mask: its token is never used;
* in a verify step a decode row also gets the mask of each position past its
  first, its matcher walked along the drafts the device will check there (n-gram
  drafts are made at the end of the row's last step and come back with its
  outputs: ``note_drafts``; a draft model's are made at the start of this step
  and handed over mid-step: ``GrammarMask.device_drafts``) and rolled back, so
  every position a grammar row may emit is sampled under its own grammar state.

A request with a constraint is a grammar row like any other (its masks come from the same fill); its rows start
all allowed, or as its grammar's mask where it has one too, and the constraint narrows them.

The fill stays on the planner thread on purpose: a fill worker (the batched
fill is C++ that releases the GIL) was measured on 2 cores and lost more to
the thread hand-offs than it won by running the planner's next steps beside
the fill (profiles/structured-output-sim-amd-epyc-2core).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from asyncbatch.engine.step_contract import GrammarMask
from asyncbatch.sampling.token_constraints import TokenConstraint, allows_any, constraint_of, walk_drafts
from asyncbatch.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarState:
    """Matchers and constraints by request seq; compiles through a lazily built ``GrammarCompiler``.

    ``make_compiler`` builds the compiler (loads the tokenizer) on first use, so engines that never see a
    grammar never pay for it, or ahead of it with ``warm_up``. Only the worker thread builds it and compiles,
    so the first grammar waits for a warm-up in progress instead of building a second compiler. Without one
    (``None``: an engine without a tokenizer) only constraints are kept. ``eos_token_id`` ends a draft walk;
    ``vocab_size`` is the logits' width (the constraints' masks).
    """

    def __init__(self, make_compiler: Callable[[], object] | None, eos_token_id: int | None = None,
                 vocab_size: int = 0) -> None:
        self._make_compiler = make_compiler
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self._compiler = None
        self._pool: ThreadPoolExecutor | None = None
        self.matchers: dict[int, object] = {}
        self.constraints: dict[int, TokenConstraint] = {}
        # Requests whose masks, narrowed by their constraint, allowed no token: their end is the caller's
        # constraints' doing (``Finish.CONSTRAINED``), not the engine's.
        self.emptied: set[int] = set()
        self.drafts: dict[int, list[int]] = {}  # seq -> the drafts its next verify step checks
        self._seqs = np.zeros(0, dtype=np.int64)  # sorted keys of ``matchers``, for vectorised lookups
        self._dirty = False

    @property
    def can_compile(self) -> bool:
        return self._make_compiler is not None

    @property
    def active(self) -> bool:
        return bool(self.matchers) or bool(self.constraints)

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """Compile ``params`` on the worker thread; the future's result is a fresh matcher (or the error)."""
        return self._worker().submit(self._new_matcher, params)

    def warm_up(self) -> Future:
        """Build the compiler on the worker thread now (``EngineConfig.structured_outputs_warmup``). One that
        cannot be built (no grammar library installed) is only logged: each grammar request then fails with
        the reason, as it would without the warm-up."""
        return self._worker().submit(self._warm)

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncbatch-grammar")
        return self._pool

    def _built(self) -> object:
        if self._compiler is None:
            if self._make_compiler is None:
                raise ValueError("structured outputs need a tokenizer, and this engine has none")
            self._compiler = self._make_compiler()
        return self._compiler

    def _warm(self) -> None:
        try:
            self._built()
        except Exception as exc:  # noqa: BLE001 - the requests that need it will report it
            logger.info("structured outputs: the engine core's grammar compiler was not built ahead (%s: %s)",
                        type(exc).__name__, exc)

    def _new_matcher(self, params: StructuredOutputsParams) -> object:
        return self._built().matcher(params)

    def add(self, seq: int, matcher: object) -> None:
        self.matchers[seq] = matcher
        self._dirty = True

    def constrain(self, seq: int, params: object) -> None:
        """Keep request ``seq``'s ``TokenConstraint`` from its ``SamplingParams``, if it has one."""
        constraint = constraint_of(params, self.vocab_size)
        if constraint is not None:
            self.constraints[seq] = constraint

    def drop(self, seq: int) -> None:
        self.drafts.pop(seq, None)
        self.constraints.pop(seq, None)
        self.emptied.discard(seq)
        if self.matchers.pop(seq, None) is not None:
            self._dirty = True

    def note_drafts(self, seqs: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> None:
        """The drafts (``[G, k]``, the first ``counts`` ``[G]`` of each) that the next verify step of the requests
        ``seqs`` ``[G]`` checks, from the step that proposed them; requests that ended are skipped."""
        live, constrained, store = self.matchers, self.constraints, self.drafts
        for seq, row, n in zip(seqs.tolist(), drafts.tolist(), counts.tolist()):
            if seq in live or seq in constrained:
                store[seq] = row[:n]

    def _sorted_seqs(self) -> np.ndarray:
        if self._dirty:
            self._seqs = np.fromiter(sorted(self.matchers), dtype=np.int64, count=len(self.matchers))
            self._dirty = False
        return self._seqs

    def advance(self, seqs: np.ndarray, tokens: np.ndarray) -> list[int]:
        """Feed each kept token (``[K]`` seqs and tokens, step order: a request's tokens of a verify step in a
        row, which one batched call takes in order) to its request's matcher and constraint; returns the
        positions whose token either rejected, and those of the same request's later tokens (their requests must
        end)."""
        refused = self._advance_matchers(seqs, tokens) if self.matchers else []
        if self.constraints:
            refused = self._advance_constraints(seqs, tokens, refused)
        return refused

    def _advance_matchers(self, seqs: np.ndarray, tokens: np.ndarray) -> list[int]:
        keys = self._sorted_seqs()
        if not len(keys) or not len(seqs):
            return []
        at = np.searchsorted(keys, seqs).clip(max=len(keys) - 1)
        index = (keys[at] == seqs).nonzero()[0]
        if not len(index):
            return []
        matchers = self.matchers
        accepted = self._compiler.accept_tokens([matchers[seq] for seq in seqs[index].tolist()],
                                                tokens[index].tolist())
        if all(accepted):
            return []
        refused, ended = [], set()
        for i, seq, ok in zip(index.tolist(), seqs[index].tolist(), accepted):
            if not ok or seq in ended:
                refused.append(i)
                ended.add(seq)
        return refused

    def _advance_constraints(self, seqs: np.ndarray, tokens: np.ndarray, refused: list[int]) -> list[int]:
        """The constraints' part of ``advance``: ``refused`` (the matchers' refusals) with theirs merged in, in
        position order; a request already refused feeds its constraint nothing more."""
        constraints = self.constraints
        # Only the constrained requests' positions, found in one array operation: a step's kept tokens may be a
        # thousand rows' while a few requests have a constraint.
        index = np.isin(seqs, np.fromiter(constraints, dtype=np.int64, count=len(constraints))).nonzero()[0]
        if not len(index):
            return refused
        ended = set(seqs[refused].tolist()) if refused else set()
        out = set(refused)
        for i, seq, token in zip(index.tolist(), seqs[index].tolist(), tokens[index].tolist()):
            if seq in ended or not constraints[seq].accept(token):
                ended.add(seq)
                out.add(i)
        return sorted(out)

    def fill(self, mask: GrammarMask, gone: Callable[[], bool] | None = None) -> tuple[float, float, float]:
        """Write every row of ``mask`` from its request's matcher (one batched library call), then mark it
        ready; returns the milliseconds it took, this thread's CPU milliseconds in them, and the milliseconds
        it waited for drafts: with ``mask.device_drafts`` it waits for the device's drafts between the first
        positions and the walk (not counted in the first two), or until ``gone()`` says the step ended
        without them."""
        t0, cpu = time.perf_counter(), time.thread_time()
        waited = 0.0
        bitmask, width = mask.bitmask, mask.width
        get = self.matchers.get
        seqs = mask.seqs.tolist()
        matchers = [get(seq) for seq in seqs]
        first = mask.first_rows().tolist()  # [G] each row's first position
        constraints = [self.constraints.get(seq) for seq in seqs] if self.constraints else None
        live, live_matchers, live_rows = range(len(matchers)), matchers, first
        if None in matchers:
            # Requests that ended since the plan: all allowed, their tokens are dropped. A constrained request
            # without a grammar: all allowed, for its constraint to narrow.
            for g, m in enumerate(matchers):
                if m is None:
                    bitmask[first[g]:first[g] + (width if g < mask.num_decode else 1)] = -1
            live = [g for g, m in enumerate(matchers) if m is not None]
            live_matchers, live_rows = [matchers[g] for g in live], [first[g] for g in live]
        if live or constraints:
            mask.begin_fill()
            if live:
                self._compiler.fill_bitmasks(live_matchers, bitmask, live_rows)
            if constraints:
                self._narrow_first(constraints, seqs, bitmask, first)
            nd = mask.num_decode  # 0 unless a verify step: no drafts to walk
            drafting = [g for g in range(nd) if matchers[g] is not None
                        or (constraints is not None and constraints[g] is not None)] if nd else None
            if drafting:
                if mask.device_drafts:
                    t_wait = time.perf_counter()
                    offered = mask.wait_drafts(gone if gone is not None else lambda: False)
                    waited = time.perf_counter() - t_wait
                    rows, counts = offered if offered is not None else (None, None)
                    drafts = [() if rows is None else rows[g, :counts[g]].tolist() for g in drafting]
                else:
                    stored = self.drafts
                    drafts = [stored.get(seqs[g], ()) for g in drafting]
                walked = [(g, d) for g, d in zip(drafting, drafts) if matchers[g] is not None]
                if walked:
                    self._compiler.fill_draft_masks([matchers[g] for g, _ in walked], [d for _, d in walked],
                                                    bitmask, [first[g] for g, _ in walked], width)
                if constraints:
                    self._narrow_drafts(constraints, [matchers[g] is not None for g in drafting], seqs, drafting,
                                        drafts, bitmask, first, width)
        now, cpu_now = time.perf_counter(), time.thread_time()
        mask.set_ready(now)
        return (now - t0 - waited) * 1e3, (cpu_now - cpu) * 1e3, waited * 1e3

    def _narrow_first(self, constraints: list, seqs: list[int], bitmask: np.ndarray, first: list[int]) -> None:
        """Narrow each constrained row's first position (``constraints[g]``, None for the others); a row left
        with nothing to sample is noted in ``emptied``."""
        for g, c in enumerate(constraints):
            if c is not None:
                c.apply(bitmask, first[g])
                if not allows_any(bitmask[first[g]], self.vocab_size):
                    self.emptied.add(seqs[g])

    def _narrow_drafts(self, constraints: list, has_grammar: list[bool], seqs: list[int], drafting: list[int],
                       drafts: list, bitmask: np.ndarray, first: list[int], width: int) -> None:
        """A verify step's positions past the first for the constrained rows among ``drafting`` (``drafts`` and
        ``has_grammar`` by the same index): narrowed along the drafts, on top of the grammar's walk where the
        row has a grammar (``walk_drafts``)."""
        for g, d, grammar in zip(drafting, drafts, has_grammar):
            c = constraints[g]
            if c is not None and not walk_drafts(c, d, bitmask, first[g], width, self.eos_token_id, grammar,
                                                 self.vocab_size):
                self.emptied.add(seqs[g])

    def close(self) -> None:
        """Cancel the compilations not begun and wait for the one running (a grammar compiles in well under a
        second), so that a closed engine leaves no thread behind."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
