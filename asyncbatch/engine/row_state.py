"""Per-request scheduling state in numpy arrays indexed by token row (vLLM V1's persistent input batch).

A running request's row in the device token buffer (``Request.token_row``,
``0 .. max_num_seqs - 1``) also indexes every array here, so a decode step of
the same requests is a handful of gathers and scatters, never a Python object
per request. A row's values are written when a request is admitted into it and
updated by array operations while it runs; when the row is released its
counters are copied back into the ``Request`` (``Scheduler._release``) and the
row is free for the next admission.

``DecodeSet`` caches the rows in the decode phase, in admission order, as one
int64 array that is rebuilt only when the set changes (a prefill completes,
a request finishes, drains or is preempted).
"""

from __future__ import annotations

import numpy as np

from asyncbatch.engine.request import Request
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.speculative.config import MAX_SPECULATIVE_TOKENS

NO_SEQ = -1  # ``RowState.seq`` of a row no request holds
# A request's parameters as ``RowState.admit_many`` reads them (``RowState.constants_of``): 11 ints (seq,
# max_tokens, ignore_eos, has stop ids, seed, top_k, uses penalties, logprobs, min_tokens, has bias, has grammar)
# and 6 floats (temperature, top_p, min_p, presence, frequency, repetition).
ROW_CONSTANTS = np.dtype([("ints", np.int64, 11), ("floats", np.float32, 6)])
# Where ``RowState``'s grouped constants come from in those 11 ints: max_tokens, seed, top_k, logprobs,
# min_tokens; and its flags (ignore_eos, has stop ids, uses penalties, has bias, has grammar).
_INT_FROM = np.array([1, 4, 5, 7, 8])
_FLAGS_FROM = np.array([2, 3, 6, 9, 10])
_RUN_PADDING = MAX_SPECULATIVE_TOKENS + 1  # history columns past max_outputs: a verify step's widest run

NO_ROWS = np.zeros(0, dtype=np.int64)  # an empty, read-only set of token rows
NO_ROWS.flags.writeable = False
_NO_BIAS = (NO_ROWS, np.zeros(0, dtype=np.float32))


def _bias_arrays(bias: dict[int, float] | None) -> tuple[np.ndarray, np.ndarray]:
    if not bias:
        return _NO_BIAS
    return (np.fromiter(bias, dtype=np.int64, count=len(bias)),
            np.fromiter(bias.values(), dtype=np.float32, count=len(bias)))


class RowState:
    """Arrays ``[S]`` (``S = max_num_seqs``) describing the request in each token row.

    Invariants while row ``r`` is held (``seq[r] != NO_SEQ``): ``num_outputs[r] <= num_scheduled[r] <=
    max_tokens[r]``, and ``num_scheduled[r] - num_outputs[r]`` tokens are in flight; ``decoding[r]`` once
    ``num_computed[r]`` reached ``prefill_len[r]`` (the request then has one token more than it has
    computed: its newest, the next input, waits in the device token buffer); ``history[r, :num_outputs[r]]``
    are its outputs. A free row's values are stale until the next ``admit``.
    """

    def __init__(self, max_num_seqs: int, max_outputs: int) -> None:
        s = max_num_seqs
        self.seq = np.full(s, NO_SEQ, dtype=np.int64)  # [S] owner's arrival_seq
        self.admit_key = np.zeros(s, dtype=np.int64)  # [S] admission counter: orders the decode rows
        self.num_computed = np.zeros(s, dtype=np.int64)  # [S] tokens whose KV is scheduled (launched included)
        self.prefill_len = np.zeros(s, dtype=np.int64)  # [S] prompt (+ outputs after a preemption) to compute
        self.num_scheduled = np.zeros(s, dtype=np.int64)  # [S] outputs received + outputs in flight
        self.num_outputs = np.zeros(s, dtype=np.int64)  # [S] outputs received
        # The constants a request's parameters fix, written once at admission: three grouped arrays, so that a
        # burst fills them with three assignments; the named arrays are their column views (``_INT_FROM``, ...).
        self._int_constants = np.zeros((s, len(_INT_FROM)), dtype=np.int64)  # [S, 5]
        self._float_constants = np.zeros((s, 6), dtype=np.float32)  # [S, 6] ROW_CONSTANTS' floats, in order
        self._flags = np.zeros((s, len(_FLAGS_FROM)), dtype=bool)  # [S, 5]
        self.max_tokens = self._int_constants[:, 0]  # [S]
        # Speculative decoding: the most tokens the request can ever hold (its prompt + max_tokens), which bounds
        # the KV the planner reserves for it, and the drafts of planned steps not applied yet (the planner's
        # ``num_computed`` and ``num_scheduled`` count every draft as accepted until ``apply`` says otherwise).
        self.token_cap = np.zeros(s, dtype=np.int64)  # [S]
        self.spec_over = np.zeros(s, dtype=np.int64)  # [S]
        self.ignore_eos = self._flags[:, 0]  # [S]
        self.has_stop_ids = self._flags[:, 1]  # [S] apply checks stop ids in Python for these rows only
        self.decoding = np.zeros(s, dtype=bool)  # [S] running and past its prefill: a member of the DecodeSet
        # Sampling constants, gathered per sampled row by the metadata writer.
        self.seed = self._int_constants[:, 1]  # [S]
        self.top_k = self._int_constants[:, 2]  # [S] 0 = off
        self.temperature, self.top_p, self.min_p, self.presence, self.frequency, self.repetition = (
            self._float_constants.T)  # [S] each
        self.top_p[:] = 1.0
        self.repetition[:] = 1.0
        self.uses_penalty = self._flags[:, 2]  # [S]
        # Sampler extras (``step_extras``): which rows need more than the plain sampler, and what.
        self.logprobs_k = self._int_constants[:, 3]  # [S] alternatives asked for; -1 = no logprobs
        self.logprobs_k[:] = -1
        self.min_tokens = self._int_constants[:, 4]  # [S]
        self.has_bias = self._flags[:, 3]  # [S] logit_bias, or min_tokens > 0
        self.has_grammar = self._flags[:, 4]  # [S] structured_outputs
        self.needs_extras = np.zeros(s, dtype=bool)  # [S] any of the three above
        self.params: list[SamplingParams | None] = [None] * s  # read for the few rows with a bias
        # Each biased row's logit_bias as ([B] int64 token ids, [B] float32 values), built once at admission.
        self.bias: list[tuple[np.ndarray, np.ndarray]] = [_NO_BIAS] * s
        # Output ids by output index, kept for the recompute after a preemption. The padding columns take
        # the tokens a verify step's row emitted past its cut (``append_runs``), never read. Resident from
        # the start (``np.full`` writes every page; ``np.zeros`` would map them lazily): a lazily mapped
        # history faults its pages in at the first outputs of new rows, in ``apply`` on the planner's
        # critical path, 0.2-5 ms per 2 MiB huge page on the 2-core VMs (5 ms of every step that admitted 64
        # into 1,024 rows; profiles/admission-burst-intel-xeon-2core). S x (max_model_len + 9) x 4 bytes:
        # 34 MB at 1,024 rows of 8,192, as vLLM's host token table.
        self.history = np.full((s, max_outputs + _RUN_PADDING), 0, dtype=np.int32)  # [S, max_outputs + pad]
        self._history_flat = self.history.reshape(-1)  # [S * stride] view
        self._stride = self.history.shape[1]
        self._columns = np.arange(_RUN_PADDING, dtype=np.int64)
        self.max_outputs = max_outputs

    @staticmethod
    def constants_of(request: Request) -> bytes:
        """What ``admit_many`` reads from ``request``'s parameters and seed, as one ``ROW_CONSTANTS`` record's
        bytes: computed once on arrival (``Scheduler.add``), so an admission burst joins its requests' records
        with one ``bytes.join`` and reads them as one array (a tenth of the cost of converting the same numbers
        from Python tuples, or of joining small arrays)."""
        p = request.params
        ints = (request.arrival_seq, p.max_tokens, p.ignore_eos, bool(p.stop_token_ids), request.seed,
                max(p.top_k, 0), p.uses_penalties, -1 if p.logprobs is None else p.logprobs, p.min_tokens,
                bool(p.logit_bias) or p.min_tokens > 0, p.structured_outputs is not None)
        floats = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        return np.array([(ints, floats)], dtype=ROW_CONSTANTS).tobytes()

    def admit_many(self, rows: np.ndarray, requests: list[Request], admit_keys: np.ndarray,
                   prefill_lens: np.ndarray, outputs: np.ndarray | None = None) -> None:
        """Fill ``rows`` ([A] int64, distinct) for ``requests`` (new, or preempted and now recomputed) at once,
        from each request's ``Request.row_constants`` (``constants_of``), one assignment per array."""
        constants = np.frombuffer(b"".join([r.row_constants or self.constants_of(r) for r in requests]),
                                  dtype=ROW_CONSTANTS)
        i, f = constants["ints"], constants["floats"]  # [A, 11] int64, [A, 6] float32
        if outputs is None:  # [A] each one's outputs (a preempted request's, to recompute), if not given
            outputs = np.fromiter((r.num_outputs for r in requests), dtype=np.int64, count=len(requests))
        self.seq[rows] = i[:, 0]
        self.admit_key[rows] = admit_keys
        self.num_computed[rows] = 0
        self.prefill_len[rows] = prefill_lens
        self.num_scheduled[rows] = outputs
        self.num_outputs[rows] = outputs
        self.token_cap[rows] = prefill_lens - outputs + i[:, 1]
        self.spec_over[rows] = 0
        self.decoding[rows] = False
        self._int_constants[rows] = i[:, _INT_FROM]
        self._float_constants[rows] = f
        flags = i[:, _FLAGS_FROM] != 0  # [A, 5]
        self._flags[rows] = flags
        self.needs_extras[rows] = flags[:, 3] | flags[:, 4] | (i[:, 7] >= 0)  # bias, grammar, logprobs
        params, bias = self.params, self.bias
        for row, request in zip(rows.tolist(), requests):
            p = request.params
            params[row] = p
            bias[row] = _bias_arrays(p.logit_bias)
            if request.num_outputs:  # a preempted request's outputs, to recompute
                self.history[row, :request.num_outputs] = request.output_token_ids

    def append_outputs(self, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """Append one output to each of ``rows`` (distinct); returns their new output counts ``[R]``."""
        n = self.num_outputs[rows]  # [R]
        self._history_flat[rows * self._stride + n] = token_ids
        n += 1
        self.num_outputs[rows] = n
        return n

    def append_runs(self, rows: np.ndarray, token_ids: np.ndarray, counts: np.ndarray) -> None:
        """Append the first ``counts[i]`` of ``token_ids[i]`` (``[R, W]``, ``W`` at most ``1 +
        MAX_SPECULATIVE_TOKENS``) to each of ``rows`` (``[R]``, distinct), in one scatter. All ``W`` are written
        (fewer array operations than selecting the counted ones): the rest land past the row's outputs, in
        columns its next outputs overwrite or in the padding, and nothing reads past ``num_outputs``."""
        n = self.num_outputs[rows]  # [R]
        self._history_flat[(rows * self._stride + n)[:, None] + self._columns[:token_ids.shape[1]]] = token_ids
        self.num_outputs[rows] = n + counts

    def outputs(self, row: int) -> list[int]:
        return self.history[row, :int(self.num_outputs[row])].tolist()


class DecodeSet:
    """Token rows of the requests in the decode phase, in admission order, as a cached int64 array.

    ``rows``, ``seqs`` and ``keys`` are read-only arrays replaced (never mutated) when the set changes, so a
    plan may keep them. ``version`` names one content: equal versions mean equal ``rows``, which lets the
    metadata writer skip rewriting what a staging buffer already holds.
    """

    def __init__(self) -> None:
        self.rows = NO_ROWS  # [D] int64 token rows
        self.seqs = NO_ROWS  # [D] int64 their requests' seqs
        self.keys = NO_ROWS  # [D] int64 their admission keys, ascending
        self.version = 0
        self._added: list[tuple[int, int]] = []  # (row, admit key) that completed their prefill
        self._dirty = False

    def add(self, row: int, admit_key: int) -> None:
        """``row`` completed its prefill; the caller has set ``RowState.decoding[row]``."""
        self._added.append((row, admit_key))
        self._dirty = True

    def add_many(self, rows: np.ndarray, admit_keys: np.ndarray) -> None:
        """``add`` for each of ``rows`` ([A] int64) with its admission key."""
        if len(rows):
            self._added.extend(zip(rows.tolist(), admit_keys.tolist()))
            self._dirty = True

    def mark_removed(self) -> None:
        """A member left (the caller has cleared ``RowState.decoding`` for it)."""
        self._dirty = True

    def new_version(self) -> int:
        self.version += 1
        return self.version

    def refresh(self, state: RowState) -> None:
        """Rebuild the cached arrays if the set changed since the last call."""
        if not self._dirty:
            return
        rows, keys = self.rows, self.keys
        # A member is current while its row is decoding under the same admission.
        keep = state.decoding[rows] & (state.admit_key[rows] == keys)  # [D]
        rows, keys = rows[keep], keys[keep]
        if self._added:
            new = np.asarray(self._added, dtype=np.int64)  # [A, 2] (row, key)
            new = new[state.decoding[new[:, 0]] & (state.admit_key[new[:, 0]] == new[:, 1])]
            new = new[np.argsort(new[:, 1], kind="stable")]
            self._added.clear()
            # Merge two key-sorted lists: the i-th new member lands after the i members before it.
            at = np.searchsorted(keys, new[:, 1]) + np.arange(len(new))  # [A]
            old = np.ones(len(rows) + len(new), dtype=bool)  # [D']
            old[at] = False
            merged_rows, merged_keys = np.empty(len(old), dtype=np.int64), np.empty(len(old), dtype=np.int64)
            merged_rows[old], merged_rows[at] = rows, new[:, 0]
            merged_keys[old], merged_keys[at] = keys, new[:, 1]
            rows, keys = merged_rows, merged_keys
        seqs = state.seq[rows]
        for array in (rows, keys, seqs):
            array.flags.writeable = False
        self.rows, self.keys, self.seqs = rows, keys, seqs
        self._dirty = False
        self.new_version()

    @property
    def dirty(self) -> bool:
        return self._dirty
