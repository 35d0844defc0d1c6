"""The simulated device: real plans and metadata, modelled time, pseudo-tokens.

The device thread copies the staging (as an H2D copy would), then models a GPU
queue: step N starts when it is launched or when step N-1 ends, whichever is
later, and ends ``SimConfig.step_seconds(...)`` after that. The thread sleeps
until the modelled end with the GIL released, its timer slack at 1 us
(``executors/timer_slack.py``: the default 50 us slack put the result a
sixth of a 1 ms step late, on the planner's critical path). Modelling the queue (instead of
timing the thread) keeps the Python thread's own wake-up jitter out of the
device timeline, as a real GPU's queue would. A step's host work (the copy, the
pseudo-tokens) is done when it is launched, during the step before it
(``PipelinedDeviceThread``), so that at a modelled end the thread only wakes and
delivers. ``is_done`` reads the modelled end, as a real device's completion
event would, not the delivery, which waits for the interpreter.

Pseudo-token of a sampled row = hash(request seed, output index, input token),
where the input token of a decode row is read from the device token buffer: a
wrong feedback path changes every later token. A request emits its
end-of-sequence token at its drawn output length (not before ``min_tokens``).

A step with grammar rows models the real device's order: the forward ends at
its modelled time, then sampling waits for the host's ``GrammarMask`` (the wait
is recorded, and idle), and each grammar row takes an allowed token picked by
its hash. The thread keeps that host work (the simulation's own, which a real
device does not put on the host) out of the planner's way: the pick, when the
mask is in early, once the planner blocks on the step (or at its end); the
next step's preparation, which needs this step's tokens and so would come as
the planner wakes to apply them, once the planner's fill has entered the
grammar library (``_wait_for_host_gap``). Logprob rows get pseudo values (the
chosen token at logprob 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from asyncbatch.config import SimConfig
from asyncbatch.engine.step_contract import GrammarMask, StepMeta
from asyncbatch.executors.base import StepHandle, StepResult
from asyncbatch.executors.device_thread import PipelinedDeviceThread, PreparedStep, ThreadedExecutor
from asyncbatch.executors.timer_slack import fine_timer_slack
from asyncbatch.profiling.marks import mark
from asyncbatch.sampling.logprobs import TokenLogprobs

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_PREFIX_WORDS = 16  # words of a row scanned first for a set bit (1,024 tokens: where JSON's punctuation lies)


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


def allowed_pick(bitmask: np.ndarray, h: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Per grammar row ``[G]``, an allowed token chosen by the row's hash ``h`` ``[G]`` (uint64, mixed); 0 for
    a row with nothing allowed. ``bitmask`` ``[G, W]`` int32, bit set = allowed (or ``[M, W]`` of which row
    ``rows[i]`` is row ``i``'s).

    Runs on the host between the mask's ready mark and the step's result (on a real device it is part of
    the sampling kernel), so it must cost next to nothing: one hash-chosen 64-token word per row, taken if
    any of its tokens is allowed (large allowed sets: string contents); else the row's first non-zero word,
    looked for in a short prefix first (small allowed sets: JSON punctuation), then in the whole row. A
    hash-chosen set bit of that word is the token. ~70 us for 128 JSON rows at vocab 49k, where hashing
    four candidate tokens per row and gathering whole rows cost ~300 us (profiles/structured-output-sim-*).
    """
    if bitmask.shape[1] % 2 == 0 and bitmask.flags.c_contiguous:
        words, lanes = bitmask.view(np.uint64), 64  # [G, W/2]
    else:
        words, lanes = np.ascontiguousarray(bitmask).view(np.uint32), 32  # [G, W]
    n = words.shape[1]
    if rows is None:
        rows = np.arange(len(h))
    column = ((h >> np.uint64(8)) % np.uint64(n)).astype(np.int64)  # [G]
    word = words[rows, column]
    missed = (word == 0).nonzero()[0]
    if len(missed):
        head = words[rows[missed], :_PREFIX_WORDS] != 0  # [F, P]
        found = head.any(axis=1)
        first = head.argmax(axis=1)
        if not found.all():
            far = (~found).nonzero()[0]
            first[far] = (words[rows[missed[far]]] != 0).argmax(axis=1)  # 0 where the row allows nothing
        column[missed] = first
        word = words[rows, column]
    word = word.astype(np.uint64)
    shift = (h >> np.uint64(40)) % np.uint64(lanes)
    if lanes == 64:  # rotate right by ``shift`` (shift 0: ``word | word``)
        rotated = (word >> shift) | (word << ((np.uint64(64) - shift) % np.uint64(64)))
    else:
        rotated = ((word | (word << np.uint64(32))) >> shift) & np.uint64(0xFFFFFFFF)
    lowest = rotated & (~rotated + np.uint64(1))  # its lowest set bit alone (a power of two: log2 is exact)
    bit = (np.log2(np.maximum(lowest, np.uint64(1)).astype(np.float64)).astype(np.int64)
           + shift.astype(np.int64)) % lanes
    return np.where(word != 0, column * lanes + bit, 0)


def chain_or_pick(bitmask: np.ndarray, rows: np.ndarray, chain: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Per grammar row ``[G]``: its plain pseudo-token ``chain`` where its bitmask row (``rows`` of ``bitmask``
    ``[M, W]``) allows it, else an allowed token chosen by its hash ``h`` (``allowed_pick``). So a grammar row
    emits the plain chain wherever the grammar lets it (a string's contents, mostly), and a modelled draft,
    which is that chain, is accepted there (``SimExecutor._prepare_verify``)."""
    lane = (chain & 31).astype(np.uint32)
    allowed = (bitmask.view(np.uint32)[rows, chain >> 5] >> lane) & np.uint32(1)
    out = chain.copy()
    miss = (allowed == 0).nonzero()[0]
    if len(miss):
        out[miss] = allowed_pick(bitmask, h[miss], rows[miss])
    return out


class SimExecutor(ThreadedExecutor):
    name = "sim"
    simulated = True

    def __init__(self, sim: SimConfig, vocab_size: int, eos_token_id: int | None, max_num_seqs: int,
                 first_token_id: int = 256, speculative: bool = False, draft_model: bool = False,
                 num_speculative_tokens: int = 0) -> None:
        self.sim = sim
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.first_token_id = min(first_token_id, vocab_size - 1)
        self.token_buffer = np.zeros(max_num_seqs, dtype=np.int64)  # the "device" token buffer
        self._device_free_at = 0.0
        # Speculative engines: what the device holds per token row (``speculative.device_state``, modelled): the
        # next input's position and the outputs so far.
        self.speculative = speculative
        self.draft_model = draft_model  # ``method="draft_model"``: each step also pays the draft's forwards
        # The drafts a grammar row's next verify checks: the plain chain on from its newest token
        # (``_chain_drafts``); an n-gram engine's are made at the end of the row's step and returned with it
        # (``StepResult.grammar_drafts``), a draft model's at the start of the verify and offered to the host
        # there (``GrammarMask.device_drafts``).
        self.num_speculative_tokens = num_speculative_tokens if speculative else 0
        self._drafts = np.zeros((max_num_seqs, self.num_speculative_tokens), dtype=np.int64)
        self.length = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_outputs = np.zeros(max_num_seqs, dtype=np.int64)
        # Each token row's drawn output length and the seed it was drawn for (``row_output_length``): a length
        # depends on the seed alone, so the pair is right from the start, for seed 0.
        self._length_seed = np.zeros(max_num_seqs, dtype=np.int64)
        self._length = np.full(max_num_seqs, int(self.output_length(np.zeros(1, dtype=np.int64))[0]), dtype=np.int64)
        self.forward_hook = None
        self._thread = PipelinedDeviceThread("asyncbatch-sim-device", self._prepare, on_start=fine_timer_slack,
                                             when_idle=self._wait_for_host_gap)

    def output_length(self, seeds: np.ndarray) -> np.ndarray:
        """Drawn output length (tokens up to and including EOS) of requests with these seeds."""
        lo, hi = self.sim.output_len_min, self.sim.output_len_max
        h = mix64(seeds.astype(np.uint64) ^ np.uint64(self.sim.seed * 7919 + 17))
        u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        if self.sim.output_len_distribution == "fixed":
            return np.full(seeds.shape, hi, dtype=np.int64)
        if self.sim.output_len_distribution == "uniform":
            return lo + np.minimum((u * (hi - lo + 1)).astype(np.int64), hi - lo)
        mean_extra = max((hi - lo) / 4.0, 1e-9)  # geometric, capped at hi
        extra = np.floor(np.log1p(-u) / np.log1p(-1.0 / (mean_extra + 1.0))).astype(np.int64)
        return np.minimum(lo + extra, hi)

    def row_output_length(self, rows: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """``output_length(seeds)`` for the requests in token rows ``rows`` (``[R]`` each), drawn again only for
        rows whose seed changed since their last draw (another request took the row). The draw is a dozen array
        operations on this thread, which holds the GIL the planner needs, at every step for every row
        (256 rows: ~50 of the ~220 us a step's preparation took on a 2-core Zen 1 VM); the lookup is three."""
        stale = self._length_seed[rows] != seeds  # [R]
        if np.count_nonzero(stale):
            changed = rows[stale]
            self._length_seed[changed] = seeds[stale]
            self._length[changed] = self.output_length(seeds[stale])
        return self._length[rows]

    def _wait_for_host_gap(self, meta: StepMeta, handle: StepHandle) -> None:
        """Before preparing a grammar step launched while the step before it ran: wait until the planner enters
        the grammar library's fill of its masks (at most until the step's modelled end).

        The step before it was just delivered, so the planner is waking to apply it, advance the matchers and
        then fill this step's masks: Python holding the interpreter, on the 1 ms chain that must end before
        this step's sampling. This thread's preparation (copies, pseudo-tokens: ~60 us of the interpreter at
        256 rows) is the simulation's own bookkeeping, which a real device does not put on the host; run
        right away it pushes the planner's wake-up back by its length. The fill runs without the interpreter,
        so preparing then costs the planner nothing (profiles/structured-output-sim-intel-xeon-2core)."""
        grammar = meta.extras.grammar if meta.extras is not None else None
        if grammar is None:
            return
        _, end = self._modelled_span(meta, handle)
        grammar.wait_fill_begun(max(0.0, end - time.perf_counter()))

    def _modelled_span(self, meta: StepMeta, handle: StepHandle) -> tuple[float, float]:
        """When the modelled device starts the step (its launch, or the end of the step before it) and ends its
        forward (the draft model's forwards included)."""
        start = max(handle.launch_time, self._device_free_at)
        end = start + self.sim.step_seconds(meta.num_tokens, meta.context_tokens)
        if self.draft_model:
            end += self.sim.draft_seconds(meta.num_tokens, meta.context_tokens, meta.num_decode, meta.spec_depth)
        return start, end

    def _prepare(self, meta: StepMeta, handle: StepHandle) -> PreparedStep:
        """Everything of a step but waiting for its modelled end: the copy, the pseudo-tokens and (unless
        grammar rows must wait for their mask first) the device state the next step reads."""
        s, t, nd, r = meta.staging, meta.num_tokens, meta.num_decode, meta.num_sampled
        t0 = time.perf_counter()
        with mark("h2d", meta.step_id):
            input_ids = s.input_ids[:t].copy()
            decode_rows = s.decode_token_rows[:nd].copy()
            logits_idx = s.logits_indices[:r].copy()
            sample_rows = s.sample_token_rows[:r].copy()
            seeds = s.sample_seed[:r].copy()
            steps = s.sample_step[:r].copy()
            s.slot_mapping[:t].sum()  # touch the metadata a real copy would move
            positions = s.positions[logits_idx[nd:]].copy() if self.speculative and r > nd else None
        s.fence.signal()
        h2d_ms = (time.perf_counter() - t0) * 1e3

        start, end = self._modelled_span(meta, handle)
        if self.forward_hook is not None:
            self.forward_hook(meta)
        extras = meta.extras
        grammar = extras.grammar if extras is not None else None
        handle._waiter = end if grammar is None else None  # when the modelled device is done (``is_done``)
        if self.speculative and meta.spec_depth:
            return self._prepare_verify(meta, handle, start, end, h2d_ms)
        if self.speculative:  # decode rows' output counts live on the device (the planner's are upper bounds)
            steps[:nd] = self.num_outputs[decode_rows]
        input_ids[:nd] = self.token_buffer[decode_rows]
        fed = input_ids[logits_idx]
        h = self._hash(seeds, steps, fed)
        banned_eos = self._eos_banned(extras, steps)
        tokens = self._pseudo_tokens(h, steps, sample_rows, seeds, banned_eos)

        def commit(end: float) -> None:
            """The device state after this step: what the next step reads."""
            self._device_free_at = end
            self.token_buffer[sample_rows] = tokens
            if self.speculative:  # one token a row: advance the modelled device state
                self.length[decode_rows] += 1
                self.num_outputs[decode_rows] += 1
                if r > nd:
                    self.length[sample_rows[nd:]] = positions + 1
                    self.num_outputs[sample_rows[nd:]] = steps[nd:] + 1

        def result(end: float, wait_ms: float = 0.0, wait_start: float = 0.0) -> StepResult:
            out = StepResult(meta.step_id, tokens, np.ones(r, dtype=bool), device_start=start, device_end=end,
                             h2d_ms=h2d_ms, forward_ms=forward_ms, mask_wait_ms=wait_ms, mask_wait_start=wait_start)
            if extras is not None:
                out.logprobs, out.prompt_logprobs = self._pseudo_logprobs(extras, tokens)
            if grammar is not None:
                out.grammar_drafts, out.grammar_num_drafts = self._next_drafts(sample_rows[grammar.index],
                                                                               seeds[grammar.index])
            return out

        forward_ms = (end - start) * 1e3
        if grammar is None:
            commit(end)
            return self._delivered_at(end, result(end))

        def pick(bitmask: np.ndarray) -> None:
            g = grammar.index
            tokens[g] = chain_or_pick(bitmask, grammar.first_rows(), tokens[g], h[g])

        return PreparedStep(end, False, self._after_mask(meta, handle, grammar, end, pick, commit, result))

    def _after_mask(self, meta: StepMeta, handle: StepHandle, grammar: GrammarMask, end: float,
                    pick: Callable[[np.ndarray], None], commit: Callable[[float], None],
                    result: Callable[..., StepResult]) -> Callable[[], StepResult]:
        """A grammar step's completion: the forward is done at ``end``; sampling waits for the host's mask like a
        real device would. The pick (``pick``: the grammar rows' tokens from the filled bitmask) is the sampling
        kernel's part, host work here: with the mask in before ``end``, it is made once the planner blocks on
        this step (it needs no interpreter until the result) or at ``end``; then ``commit`` writes the device
        state and ``result`` builds the step's result (sampled at, mask wait ms, wait start)."""

        def complete_after_mask() -> StepResult:
            with mark("forward", meta.step_id, " sim"):
                early = grammar.wait_ready(max(0.0, end - time.perf_counter()))
                if early:
                    handle.wait_awaited(max(0.0, end - time.perf_counter()))
            if not early:
                with mark("grammar_mask_wait", meta.step_id):
                    grammar.wait_ready()
            sampled = max(end, grammar.ready_time)
            pick(grammar.bitmask)
            commit(sampled)
            self._sleep_until(end, meta.step_id, " sim")
            return result(sampled, (sampled - end) * 1e3, end)

        return complete_after_mask

    @staticmethod
    def _hash(seeds: np.ndarray, steps: np.ndarray, fed: np.ndarray) -> np.ndarray:
        """The pseudo-token hash of output ``steps`` of requests ``seeds`` fed token ``fed`` (``[N]`` each)."""
        return SimExecutor._hash_fed(SimExecutor._hash_base(seeds, steps), fed)

    @staticmethod
    def _hash_base(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """The part of ``_hash`` that does not depend on the fed token (broadcasts: a verify step hashes every
        position's at once)."""
        return seeds.astype(np.uint64, copy=False) * np.uint64(1_000_003) ^ mix64(steps.astype(np.uint64, copy=False))

    @staticmethod
    def _hash_fed(base: np.ndarray, fed: np.ndarray) -> np.ndarray:
        """``_hash`` from its ``_hash_base`` and the fed token."""
        return mix64(base ^ (fed.astype(np.uint64, copy=False) << np.uint64(20)))

    def _prepare_verify(self, meta: StepMeta, handle: StepHandle, start: float, end: float,
                        h2d_ms: float) -> PreparedStep:
        """A speculative engine's step.

        Each decode row's tokens are the plain chain (output ``n`` = hash(seed, n, output ``n - 1``)) from its
        device state, ``1 + depth`` of them; of its drafts, each is accepted with probability
        ``SimConfig.spec_acceptance`` (a hash of the seed and the output index), the run stopping at the first
        rejection and at the KV the planner reserved. So a speculative run emits exactly a plain run's tokens,
        more of them per step, and the planner's one-step-late reconciliation runs as on a real device. A grammar
        row's token at each position is ``chain_or_pick`` under that position's mask (the host's walk along the
        drafts this sim returned for it, ``_next_drafts``: the chain itself), so its draft there is accepted where
        the grammar allows the chain and the coin says so, and its run stops after an EOS (a real device finds
        no mask past it: ``GrammarCompiler.fill_draft_masks``); a draft model's grammar rows get the same drafts,
        made here and offered to the host's walk before the mask is waited for. ``min_tokens``' EOS ban holds
        at each position by its output index, and logprob rows get an entry per position
        (``LogprobRows.entries``)."""
        s, nd, r, depth = meta.staging, meta.num_decode, meta.num_sampled, meta.spec_depth
        width = depth + 1
        rows, seeds = s.sample_token_rows[:r].copy(), s.sample_seed[:r].copy()
        steps = s.sample_step[:r].copy()  # exact for prefill rows; decode rows' come from the device state
        tokens = np.zeros((r, width), dtype=np.int64)
        fed = self.token_buffer[rows].copy()
        prefill_positions = None
        if r > nd:  # prefill rows' last token: its pseudo-token's input
            last = s.logits_indices[nd:r]
            fed[nd:] = s.input_ids[last]
            prefill_positions = s.positions[last] + 1
        steps[:nd] = self.num_outputs[rows[:nd]]
        usable = np.minimum(depth, np.maximum(s.decode_context_lens[:nd] - self.length[rows[:nd]] - 1, 0))  # [D]
        # What does not depend on the chain is hashed for every position at once (the host's time in a sim step
        # is time the planner waits for the GIL); only the fed token is hashed position by position.
        index = steps[:, None] + np.arange(width)  # [R, W] output index of each position (prefill rows: 0 only)
        index_u = index.astype(np.uint64)
        base = self._hash_base(seeds[:, None], index_u)  # [R, W]
        ends = None  # [R, W] the request's drawn length is reached: EOS (None: nowhere in this step)
        if self.eos_token_id is not None:
            ends = index + 1 >= self.row_output_length(rows, seeds)[:, None]
            if not ends.any():
                ends = None
        extras = meta.extras
        banned_eos = self._eos_banned(extras, index)  # [R, W]
        fed_u = fed.astype(np.uint64)
        hashes = np.zeros((r, width), dtype=np.uint64)  # each position's hash: a grammar row's pick
        for j in range(width):
            n = r if j == 0 else nd
            h = hashes[:n, j] = self._hash_fed(base[:n, j], fed_u[:n])  # = _hash(seeds, steps + j, fed)
            fed_u[:n] = tokens[:n, j] = self._tokens_of(h, None if ends is None else ends[:n, j],
                                                        None if banned_eos is None else banned_eos[:n, j])
        # Draft j is accepted with probability spec_acceptance, while usable; the run stops at the first rejection.
        coin = mix64(seeds[:nd, None].astype(np.uint64) ^ mix64(index_u[:nd, :depth] + np.uint64(0x5EC))) >> np.uint64(11)
        accept = (coin.astype(np.float64) / float(1 << 53) < self.sim.spec_acceptance) & (np.arange(depth) < usable[:, None])
        emitted = np.ones(r, dtype=np.int64)
        emitted[:nd] += np.logical_and.accumulate(accept, axis=1).sum(axis=1)
        drafted = usable > 0
        grammar = extras.grammar if extras is not None else None
        if grammar is not None and grammar.device_drafts:
            grammar.offer_drafts(*self._chain_drafts(rows[grammar.index], seeds[grammar.index]))
        forward_ms = (end - start) * 1e3

        def commit(end: float) -> None:
            """The device state after this step: what the next step reads."""
            self._device_free_at = end
            if prefill_positions is not None:
                self.length[rows[nd:]] = prefill_positions
                self.num_outputs[rows[nd:]] = steps[nd:]
            self.token_buffer[rows] = tokens[np.arange(r), emitted - 1]
            self.length[rows[:nd]] += emitted[:nd]
            self.num_outputs[rows] += emitted

        def result(sampled: float, wait_ms: float = 0.0, wait_start: float = 0.0) -> StepResult:
            out = StepResult(meta.step_id, tokens, np.ones(r, dtype=bool), device_start=start, device_end=sampled,
                             h2d_ms=h2d_ms, forward_ms=forward_ms, mask_wait_ms=wait_ms, mask_wait_start=wait_start,
                             num_emitted=emitted, spec_counts=(int(drafted.sum()), int(usable.sum()),
                                                               int((emitted[:nd] - 1).sum())))
            if extras is not None:
                out.logprobs, out.prompt_logprobs = self._pseudo_logprobs(extras, tokens, nd)
            if grammar is not None:
                out.grammar_drafts, out.grammar_num_drafts = self._next_drafts(rows[grammar.index],
                                                                               seeds[grammar.index])
            return out

        if grammar is None:
            commit(end)
            return self._delivered_at(end, result(end))

        def pick(bitmask: np.ndarray) -> None:
            g, first = grammar.index, grammar.first_rows()
            tokens[g, 0] = chain_or_pick(bitmask, first, tokens[g, 0], hashes[g, 0])
            gd = grammar.num_decode  # decode rows with a mask per position (the first gd of g)
            if not gd or not depth:
                return
            d = g[:gd]
            # Past position 0 a row's inputs are its drafts, the chain; each position's pick decides whether the
            # next draft is accepted (with the coin), and the run ends after an EOS.
            kept = accept[d]  # [Gd, depth]
            drafts = self._drafts[rows[d]]
            for j in range(1, width):
                tokens[d, j] = chain_or_pick(bitmask, first[:gd] + j, tokens[d, j], hashes[d, j])
                before = tokens[d, j - 1]
                kept[:, j - 1] &= (before == drafts[:, j - 1]) & (before != self.eos_token_id)
            emitted[d] = 1 + np.logical_and.accumulate(kept, axis=1).sum(axis=1)

        return PreparedStep(end, False, self._after_mask(meta, handle, grammar, end, pick, commit, result))

    def _next_drafts(self, rows: np.ndarray, seeds: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """After a step's commit: the drafts the next verify of grammar rows ``rows`` (token rows; ``seeds``, ``[G]``
        each) checks, returned to the host (``_chain_drafts``). None in an engine that does not return drafts
        (not speculative, or a draft model: it offers them in the verify step itself)."""
        if not self.num_speculative_tokens or self.draft_model:
            return None, None
        return self._chain_drafts(rows, seeds)

    def _chain_drafts(self, rows: np.ndarray, seeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The drafts the next verify of grammar rows ``rows`` (token rows; ``seeds``, ``[G]`` each) checks, from
        the device state after the rows' newest token, ``[G, k]``, and their counts (k each), kept for that
        verify: the plain chain on from each row's newest token, what an n-gram proposer that always finds a
        match, or a draft model that always agrees with the target, would propose."""
        k = self.num_speculative_tokens
        index = self.num_outputs[rows]  # [G] the output index of the next step's first position
        fed = self.token_buffer[rows]
        lengths = self.row_output_length(rows, seeds) if self.eos_token_id is not None else None
        drafts = np.zeros((len(rows), k), dtype=np.int64)
        for j in range(k):
            h = self._hash(seeds, index + j, fed)
            fed = drafts[:, j] = self._tokens_of(h, None if lengths is None else index + j + 1 >= lengths, None)
        self._drafts[rows] = drafts
        return drafts, np.full(len(rows), k, dtype=np.int64)

    def is_done(self, handle: StepHandle) -> bool:
        """The modelled device has finished the step (its end has passed), or its result is in. A real device's
        completion event says so at the end of the step whatever the host does; the thread that delivers the
        result here needs the interpreter first, which the planner may be holding (a step whose sampling waits
        for a grammar mask is done when delivered)."""
        end = handle._waiter
        return handle.is_done() or (end is not None and time.perf_counter() >= end)

    def _delivered_at(self, end: float, result: StepResult) -> PreparedStep:
        """A step whose result is known now and whose device state is written: final, delivered at ``end``."""

        def complete() -> StepResult:
            self._sleep_until(end, result.step_id, " sim")
            return result

        return PreparedStep(end, True, complete)

    @staticmethod
    def _sleep_until(t: float, step_id: int, label: str) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            with mark("forward", step_id, label):
                time.sleep(delay)

    def _pseudo_tokens(self, h: np.ndarray, steps: np.ndarray, rows: np.ndarray, seeds: np.ndarray,
                       banned_eos: np.ndarray | None) -> np.ndarray:
        """Hash tokens in ``[first_token_id, V)``, never EOS except at the drawn length (unless banned); ``rows``:
        the sampled rows' token rows, ``seeds`` their requests' seeds."""
        ends = None if self.eos_token_id is None else steps + 1 >= self.row_output_length(rows, seeds)
        return self._tokens_of(h, ends, banned_eos)

    def _tokens_of(self, h: np.ndarray, ends: np.ndarray | None, banned_eos: np.ndarray | None) -> np.ndarray:
        """``_pseudo_tokens`` with the rows that reached their drawn length (``ends``: EOS there) known."""
        span = self.vocab_size - self.first_token_id
        tokens = self.first_token_id + (h % np.uint64(span)).astype(np.int64)
        eos = self.eos_token_id
        if eos is None:
            return tokens
        if eos >= self.first_token_id:  # a hash may land on EOS: moved off it (below first_token_id it cannot)
            tokens = np.where(tokens == eos, tokens + 1 if eos + 1 < self.vocab_size else self.first_token_id,
                              tokens)
        if ends is not None:
            if banned_eos is not None:
                ends = ends & ~banned_eos
            tokens = np.where(ends, eos, tokens)
        return tokens

    def _eos_banned(self, extras, steps: np.ndarray) -> np.ndarray | None:
        """Where a -inf bias bans EOS (``min_tokens``), for sampled rows at output indices ``steps`` (``[R]``, or
        ``[R, W]`` for every position of a verify step): a bool array of that shape; the sim honours no other
        bias."""
        if extras is None or extras.bias is None or self.eos_token_id is None:
            return None
        bias = extras.bias
        hit = (bias.token_ids == self.eos_token_id) & np.isneginf(bias.values)
        banned = np.zeros(steps.shape, dtype=bool)
        for row, until in zip(bias.index[hit].tolist(), bias.until[hit].tolist()):
            banned[row] |= steps[row] < until
        return banned

    def _pseudo_logprobs(self, extras, tokens: np.ndarray, num_decode: int = 0):
        """Simulated logprobs: the sampled (or prompt) token has probability 1, the other top ids -inf. ``tokens``
        ``[R]``, or ``[R, W]`` in a verify step (an entry per position of a decode row: ``LogprobRows.entries``)."""
        def columns(ids: np.ndarray, k: int) -> TokenLogprobs:
            top = (ids[:, None] + np.arange(k)) % self.vocab_size
            top_lp = np.where(np.arange(k) == 0, 0.0, -np.inf).astype(np.float32)[None, :].repeat(len(ids), 0)
            return TokenLogprobs(np.zeros(len(ids), dtype=np.float32), np.ones(len(ids), dtype=np.int64), top, top_lp)

        chosen = None
        if extras.logprobs is not None:
            if tokens.ndim == 2:
                rows, positions = extras.logprobs.entries(num_decode, tokens.shape[1])
                ids = tokens[extras.logprobs.index[rows], positions]
            else:
                ids = tokens[extras.logprobs.index]
            chosen = columns(ids, extras.logprobs.max_k)
        prompt = None if extras.prompt_logprobs is None else columns(extras.prompt_logprobs.target_ids,
                                                                      extras.prompt_logprobs.max_k)
        return chosen, prompt

    def describe(self) -> dict:
        return {"backend": "sim", "simulated": True, "sim": {
            f: getattr(self.sim, f) for f in self.sim.__slots__}}
