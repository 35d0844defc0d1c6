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

# The output history's dtype. The appends cast the step's int64 ids to it *before* their scatter: numpy releases
# the GIL inside a scatter that casts, at any size (numpy 2.4: 256 ids), and the planner, on the device's
# critical path, then waits for whichever thread took the GIL to hand it back (measured with a thread spinning
# beside it: a 256-row append took 5.3 ms instead of 12 us; tests/test_row_state_gil.py).
_HISTORY = np.int32

NO_SEQ = -1  # ``RowState.seq`` of a row no request holds
# A request's parameters as ``RowState.admit_many`` writes them (``RowState.constants_of``, made on arrival): the
# int64 constants (max_tokens, seed, top_k, logprobs, min_tokens), the float32 ones (temperature, top_p, min_p,
# presence, frequency, repetition) and the flags (ignore_eos: an EOS does not end it, ``SamplingParams.eos_ends``;
# has stop ids, uses penalties, has bias (or min_tokens), has grammar, needs extras), each group in ``RowState``'s
# column order.
ROW_CONSTANTS = np.dtype([("ints", np.int64, 5), ("floats", np.float32, 6), ("flags", np.bool_, 6)], align=True)
# ``RowState``'s counters, the rows of its ``counters`` table in this order: what admission sets per row
# (``admit_many`` takes them as one ``[A, 8]`` block) and planning and ``apply`` update.
ROW_COUNTERS = ("num_computed", "seq", "admit_key", "prefill_len", "num_scheduled", "num_outputs", "token_cap",
                "spec_over")
# The flags' names, in ROW_CONSTANTS' "flags" order (``RowState``'s arrays of the same names).
ROW_FLAGS = ("ignore_eos", "has_stop_ids", "uses_penalty", "has_bias", "has_grammar", "needs_extras")
_HAS_BIAS = ROW_FLAGS.index("has_bias")
_NUM_OUTPUTS = ROW_COUNTERS.index("num_outputs")
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
        # The counters (``ROW_COUNTERS``) as one table, so that an admission burst writes them with one
        # assignment; the named arrays are its rows, each contiguous (the decode path gathers and scatters them
        # every step: a third faster than on a column of a row-major table):
        #   num_computed  [S] tokens whose KV is scheduled (launched included)
        #   seq           [S] owner's arrival_seq
        #   admit_key     [S] admission counter: orders the decode rows
        #   prefill_len   [S] prompt (+ outputs after a preemption) to compute
        #   num_scheduled [S] outputs received + outputs in flight
        #   num_outputs   [S] outputs received
        #   token_cap     [S] speculative decoding: the most tokens the request can ever hold (its prompt +
        #                 max_tokens), which bounds the KV the planner reserves for it
        #   spec_over     [S] speculative decoding: drafts of planned steps not applied yet (the planner's
        #                 ``num_computed`` and ``num_scheduled`` count every draft as accepted until ``apply``
        #                 says otherwise)
        self.counters = np.zeros((len(ROW_COUNTERS), s), dtype=np.int64)  # [8, S]
        (self.num_computed, self.seq, self.admit_key, self.prefill_len, self.num_scheduled, self.num_outputs,
         self.token_cap, self.spec_over) = self.counters
        self.seq[:] = NO_SEQ
        # The constants a request's parameters fix, written once at admission: three grouped tables in
        # ``ROW_CONSTANTS``' order, so that a burst fills them with three assignments; the named arrays are their
        # rows.
        self.int_constants = np.zeros((5, s), dtype=np.int64)  # [5, S]
        self.float_constants = np.zeros((6, s), dtype=np.float32)  # [6, S]
        self._flags = np.zeros((6, s), dtype=bool)  # [6, S]
        self.max_tokens, self.seed, self.top_k, self.logprobs_k, self.min_tokens = self.int_constants  # [S] each
        # top_k: 0 = off; logprobs_k: alternatives asked for, -1 = no logprobs
        self.logprobs_k[:] = -1
        self.temperature, self.top_p, self.min_p, self.presence, self.frequency, self.repetition = (
            self.float_constants)  # [S] each; sampling constants, gathered per sampled row by the writer
        self.top_p[:] = 1.0
        self.repetition[:] = 1.0
        # ``has_stop_ids``: apply checks stop ids in Python for these rows only. Sampler extras
        # (``step_extras``): which rows need more than the plain sampler (``needs_extras``: any of ``has_bias``
        # (logit_bias, or min_tokens > 0), ``has_grammar`` (a token mask: structured_outputs, allowed_token_ids,
        # bad_words) and logprobs), and what.
        (self.ignore_eos, self.has_stop_ids, self.uses_penalty, self.has_bias, self.has_grammar,
         self.needs_extras) = self._flags  # [S] each
        self.decoding = np.zeros(s, dtype=bool)  # [S] running and past its prefill: a member of the DecodeSet
        # Set at admission for the rows with a bias (or min_tokens), the only ones that read them; stale elsewhere.
        self.params: list[SamplingParams | None] = [None] * s
        # Each biased row's logit_bias as ([B] int64 token ids, [B] float32 values), built once at admission.
        self.bias: list[tuple[np.ndarray, np.ndarray]] = [_NO_BIAS] * s
        # Output ids by output index, kept for the recompute after a preemption. The padding columns take
        # the tokens a verify step's row emitted past its cut (``append_runs``), never read. Resident from
        # the start (``np.full`` writes every page; ``np.zeros`` would map them lazily): a lazily mapped
        # history faults its pages in at the first outputs of new rows, in ``apply`` on the planner's
        # critical path, 0.2-5 ms per 2 MiB huge page on the 2-core VMs (5 ms of every step that admitted 64
        # into 1,024 rows; profiles/admission-burst-intel-xeon-2core). S x (max_model_len + 9) x 4 bytes:
        # 34 MB at 1,024 rows of 8,192, as vLLM's host token table.
        self.history = np.full((s, max_outputs + _RUN_PADDING), 0, dtype=_HISTORY)  # [S, max_outputs + pad]
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
        logprobs = -1 if p.logprobs is None else p.logprobs
        bias, grammar = bool(p.logit_bias) or p.min_tokens > 0, p.constrains_tokens
        # A top_k past the vocabulary keeps every token, as 0 does: 2**63 and up would not fit the int64 column.
        top_k = p.top_k if 0 < p.top_k < 2**63 else 0
        ints = (p.max_tokens, request.seed, top_k, logprobs, p.min_tokens)
        floats = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        flags = (not p.eos_ends, bool(p.stop_token_ids), p.uses_penalties, bias, grammar, bias or grammar or logprobs >= 0)
        return np.array([(ints, floats, flags)], dtype=ROW_CONSTANTS).tobytes()

    def admit_many(self, rows: np.ndarray, requests: list[Request], counters: np.ndarray,
                   decoding: np.ndarray) -> None:
        """Fill ``rows`` ([A] int64, distinct) for ``requests`` (new, or preempted and now recomputed) at once:
        ``counters`` ([A, 8] int64, one row each) their ``ROW_COUNTERS`` as admission sets them, ``decoding`` ([A] bool or
        int) which of them complete their prefill in the admitting step, and the constants from each request's
        ``Request.row_constants`` (``constants_of``): one assignment per group."""
        constants = np.frombuffer(b"".join([r.row_constants or self.constants_of(r) for r in requests]),
                                  dtype=ROW_CONSTANTS)
        self.counters[:, rows] = counters.T
        self.decoding[rows] = decoding
        self.int_constants[:, rows] = constants["ints"].T
        self.float_constants[:, rows] = constants["floats"].T
        self._flags[:, rows] = constants["flags"].T
        # Per request in Python only where needed: the rows with a bias (or min_tokens), the only readers of
        # ``params`` and ``bias`` (``step_extras``), and recomputes after a preemption, whose outputs go back
        # into the history. A burst of plain requests has neither.
        for i in constants["flags"][:, _HAS_BIAS].nonzero()[0].tolist():
            row, p = int(rows[i]), requests[i].params
            self.params[row] = p
            self.bias[row] = _bias_arrays(p.logit_bias)
        for i in counters[:, _NUM_OUTPUTS].nonzero()[0].tolist():
            request = requests[i]
            self.history[int(rows[i]), :request.num_outputs] = request.output_token_ids

    def append_outputs(self, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """Append one output to each of ``rows`` (distinct); returns their new output counts ``[R]``."""
        n = self.num_outputs[rows]  # [R]
        self._history_flat[rows * self._stride + n] = token_ids.astype(_HISTORY, copy=False)  # cast first (``_HISTORY``)
        n += 1
        self.num_outputs[rows] = n
        return n

    def append_runs(self, rows: np.ndarray, token_ids: np.ndarray, counts: np.ndarray) -> None:
        """Append the first ``counts[i]`` of ``token_ids[i]`` (``[R, W]``, ``W`` at most ``1 +
        MAX_SPECULATIVE_TOKENS``) to each of ``rows`` (``[R]``, distinct), in one scatter. All ``W`` are written
        (fewer array operations than selecting the counted ones): the rest land past the row's outputs, in
        columns its next outputs overwrite or in the padding, and nothing reads past ``num_outputs``."""
        n = self.num_outputs[rows]  # [R]
        self._history_flat[(rows * self._stride + n)[:, None] + self._columns[:token_ids.shape[1]]] = (
            token_ids.astype(_HISTORY, copy=False))  # cast first (``_HISTORY``)
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
        # Members that completed their prefill since the last refresh: ([n] rows, [n] admit keys) pairs, an
        # admission batch's as the arrays it came with (keys ascending), a running prefill's as one-element lists.
        self._added: list[tuple[np.ndarray | list[int], np.ndarray | list[int]]] = []
        self._dirty = False

    def add(self, row: int, admit_key: int) -> None:
        """``row`` completed its prefill; the caller has set ``RowState.decoding[row]``."""
        self._added.append(([row], [admit_key]))
        self._dirty = True

    def add_many(self, rows: np.ndarray, admit_keys: np.ndarray) -> None:
        """``add`` for each of ``rows`` ([A] int64) with its admission key, ``admit_keys`` ascending."""
        if len(rows):
            self._added.append((rows, admit_keys))
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
            added = self._added
            if len(added) == 1:  # one admission batch (or one prefill): in key order already
                new_rows, new_keys = np.asarray(added[0][0], dtype=np.int64), np.asarray(added[0][1], dtype=np.int64)
            else:
                new_rows = np.concatenate([part[0] for part in added]).astype(np.int64, copy=False)
                new_keys = np.concatenate([part[1] for part in added]).astype(np.int64, copy=False)
                order = np.argsort(new_keys, kind="stable")
                new_rows, new_keys = new_rows[order], new_keys[order]
            added.clear()
            current = state.decoding[new_rows] & (state.admit_key[new_rows] == new_keys)  # [A]
            new_rows, new_keys = new_rows[current], new_keys[current]
            if len(new_keys) and (not len(keys) or new_keys[0] > keys[-1]):
                # The usual case: every new member was admitted after every member (admission keys grow).
                rows, keys = np.concatenate([rows, new_rows]), np.concatenate([keys, new_keys])
            elif len(new_keys):
                # Merge two key-sorted lists: the i-th new member lands after the i members before it.
                at = np.searchsorted(keys, new_keys) + np.arange(len(new_keys))  # [A]
                old = np.ones(len(rows) + len(new_keys), dtype=bool)  # [D']
                old[at] = False
                merged_rows, merged_keys = np.empty(len(old), dtype=np.int64), np.empty(len(old), dtype=np.int64)
                merged_rows[old], merged_rows[at] = rows, new_rows
                merged_keys[old], merged_keys[at] = keys, new_keys
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
