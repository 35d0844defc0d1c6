"""Output processing: turns the core's columnar ``StepOutputs`` into text, streams and final outputs.

It runs on the frontend's receiver thread, in the caller's process, never on
the engine core's launch path:

    core      [apply N ─ send StepOutputs N] [plan N+2] ...
    frontend                   └─► [detokenize N, stop strings N, stream N, record N]
    core  ◄── FinishRequests (stop string found in R) ── frontend
              (R's blocks are freed at the core's next inbox pass; tokens R got meanwhile are dropped here)

Tokens that arrive for a request after it finished (the step it was still in
when its stop was seen) are dropped: never emitted, never counted.

Per row and step the work is what the request needs (``RequestHandle``): a
``token_only`` request (not streamed, no stop strings, no logprobs) only gets
its id appended until its last token (after its first, by ``TokenLog``, a
few array operations for all such rows of a step), and its text is decoded once at the
end (here, or for ``LLM.generate`` by its caller with the whole batch:
``RequestHandle.text_by_caller``); without a tokenizer
(``skip_tokenizer_init``) no detokenizer is called.
Detokenizing is timed apart (``StepRecord.detok_ms``) so the timeline shows
what it costs. Callers wake
only after the step's record is in the timeline, so ``stats()`` read after a
request finished includes the step that finished it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from asyncbatch.engine.messages import (
    CONSTRAINED_MESSAGE,
    GRAMMAR_MESSAGE,
    NON_FINITE_MESSAGE,
    REFUSED_MESSAGE,
    Finish,
    FinishRequests,
    LogprobColumns,
    StepAck,
    StepOutputs,
)
from asyncbatch.errors import ConstraintConflictError, RequestFailedError
from asyncbatch.frontend.request_handle import RequestHandle
from asyncbatch.frontend.token_log import TokenLog
from asyncbatch.outputs import Logprobs, StreamDelta
from asyncbatch.profiling.marks import mark
from asyncbatch.profiling.timeline import Timeline

_ENDED_MESSAGES = {Finish.ERROR: NON_FINITE_MESSAGE, Finish.REFUSED: REFUSED_MESSAGE, Finish.GRAMMAR: GRAMMAR_MESSAGE,
                   Finish.CONSTRAINED: CONSTRAINED_MESSAGE}
# What a stream raises for a request the core ended, where not ``RequestFailedError`` itself.
_ENDED_FAILURES = {Finish.CONSTRAINED: ConstraintConflictError}
_NONE, _STOP_TOKEN = int(Finish.NONE), int(Finish.STOP_TOKEN)


class OutputProcessor:
    """Applies ``StepOutputs`` to the caller-visible ``RequestHandle`` of each request (by seq)."""

    def __init__(self, handles: dict[int, RequestHandle], timeline: Timeline, hidden_token_ids: frozenset[int],
                 send: Callable[[object], None], ack_steps: bool) -> None:
        self._handles = handles  # live handles by seq; the frontend adds, this removes finished ones
        self._timeline = timeline
        self._hidden = hidden_token_ids  # EOS: kept in token_ids, not detokenized
        self._hidden_ids = np.fromiter(hidden_token_ids, dtype=np.int64, count=len(hidden_token_ids))
        self.send = send
        self._ack_steps = ack_steps  # synchronous mode: the core waits for our StepAck
        # token_only requests' ids after their first, cut out of each step's arrays (``TokenLog``); False: every
        # row one by one (the reference the log is tested against).
        self.log_tokens = True
        self._log = TokenLog(handles, hidden_token_ids)

    def process(self, out: StepOutputs) -> None:
        start = time.perf_counter()
        record = out.record
        step_id = record.step_id if record is not None else None
        finishes: list[tuple[RequestHandle, tuple]] = []
        ended: list[int] = []
        ended_codes: list[Finish] = []
        accepted = 0
        detok_s = 0.0
        with mark("output", step_id):
            if record is not None and len(out.first_scheduled):
                cached = out.first_cached.tolist() if out.first_cached is not None else [0] * len(out.first_scheduled)
                for seq, num_cached in zip(out.first_scheduled.tolist(), cached):
                    handle = self._handles.get(seq)
                    if handle is not None and handle.metrics.first_scheduled_time is None:
                        # The first admission's, as vLLM's: a recompute after a preemption does not change it.
                        handle.metrics.first_scheduled_time = record.plan_end
                        handle.num_cached_tokens = num_cached
            handles = self._handles
            if out.prompt_logprobs is not None:
                self._prompt_logprobs(out.prompt_logprobs)
            hidden = self._hidden
            text_rows: list[tuple[int, RequestHandle, int, int]] = []  # rows with detokenizer work
            other_rows: list[tuple[int, RequestHandle, int, int]] = []  # last tokens of requests without text
            if out.num_tokens is None:
                seqs, tokens, codes, index = out.seqs, out.token_ids, out.finish, None
                rest = self._log.log(seqs, tokens, codes) if self.log_tokens else None
                if rest is not None:  # the rows of tracked requests are logged: they are live, so accepted
                    index = rest.nonzero()[0]  # [K] the other rows
                    accepted += len(seqs) - len(index)
                    seqs, tokens, codes = seqs[index], tokens[index], codes[index]
                positions = range(len(seqs)) if index is None else index.tolist()  # rows of ``out``
                for i, seq, token, code in zip(positions, seqs.tolist(), tokens.tolist(), codes.tolist()):
                    handle = handles.get(seq)
                    if handle is None or handle.done.is_set():
                        continue
                    accepted += 1
                    if code == _NONE and handle.token_only:  # the fast path: the id, and nothing else until the end
                        if handle.metrics.first_token_time is None:
                            handle.metrics.first_token_time = start
                        handle.token_ids.append(token)
                        if handle.text_ids is not None and token not in hidden:
                            handle.text_ids.append(token)
                        if self.log_tokens:
                            self._log.track(seq)
                        continue
                    (text_rows if handle.has_text else other_rows).append((i, handle, token, code))
            else:
                self._log.flush()  # a speculative step extends the lists itself
                accepted = self._accept_runs(out, start, text_rows, other_rows)
            if self._log.num_steps and (other_rows or text_rows or len(out.ended_seqs)):
                # Requests about to end (or to fail): their lists are read from here on.
                self._log.flush([h.seq for _, h, _, _ in other_rows] + [h.seq for _, h, _, _ in text_rows]
                                + out.ended_seqs.tolist())
            if other_rows:
                accepted -= self._accept_rows(other_rows, out, start, finishes, ended, ended_codes)
            if text_rows:  # rows are independent, so the ones with text work run together, timed and marked
                with mark("detokenize", step_id):
                    detok_start = time.perf_counter()
                    accepted -= self._accept_rows(text_rows, out, start, finishes, ended, ended_codes)
                    detok_s = time.perf_counter() - detok_start
            for seq, code in zip(out.ended_seqs.tolist(), out.ended_codes.tolist()):
                handle = self._handles.get(seq)
                if handle is not None and not handle.finished:
                    code = Finish(code)
                    self._flush(handle, "", [], finishes, (code.reason, None, start, _ENDED_MESSAGES.get(code),
                                                           _ENDED_FAILURES.get(code, RequestFailedError)))
        if ended:
            self.send(FinishRequests(ended, ended_codes))
        if record is not None:
            record.output_start = start
            record.output_end = time.perf_counter()
            record.output_tokens = accepted
            record.detok_ms = detok_s * 1e3
            self._timeline.add(record)
        for handle, args in finishes:
            handle.finish(*args)
            self._handles.pop(handle.seq, None)
            self._log.untrack(handle.seq)
        if self._log.num_steps >= self._log.max_steps:
            self._log.flush()
        if record is not None and self._ack_steps:
            self.send(StepAck(record.step_id))

    def _accept_runs(self, out: StepOutputs, now: float, text_rows: list, other_rows: list) -> int:
        """A speculative step's rows, several tokens each (``StepOutputs.num_tokens``): a ``token_only`` request
        that goes on takes its tokens in one ``extend`` (and its text ids, hidden ids left out for the whole
        step at once, in another); the others' tokens join ``text_rows``/``other_rows`` one token a row, in
        order, the finish code on the last, each with its index in ``token_ids`` (where its logprobs are).
        Returns the tokens accepted."""
        handles = self._handles
        tokens, nums = out.token_ids.tolist(), out.num_tokens.tolist()
        text, text_nums = tokens, nums  # the ids a deferred detokenizer decodes, and how many per row
        shown = self._shown(out.token_ids)
        if shown is not None:
            text = out.token_ids[shown].tolist()
            text_nums = np.add.reduceat(shown, np.cumsum(out.num_tokens) - out.num_tokens).tolist()
        accepted = end = text_end = 0
        for i, (seq, n, text_n, code) in enumerate(zip(out.seqs.tolist(), nums, text_nums, out.finish.tolist())):
            start, end = end, end + n
            text_start, text_end = text_end, text_end + text_n
            handle = handles.get(seq)
            if handle is None or handle.done.is_set():
                continue
            accepted += n
            if code == _NONE and handle.token_only:
                if handle.metrics.first_token_time is None:
                    handle.metrics.first_token_time = now
                handle.token_ids.extend(tokens[start:end])
                if handle.text_ids is not None:
                    handle.text_ids.extend(text[text_start:text_end])
                continue
            rows = text_rows if handle.has_text else other_rows
            run = tokens[start:end]
            rows.extend((start + j, handle, token, _NONE) for j, token in enumerate(run[:-1]))
            rows.append((end - 1, handle, run[-1], code))
        return accepted

    def _shown(self, token_ids: np.ndarray) -> np.ndarray | None:
        """``[T]`` bool: the token is not hidden (EOS); None when none of ``token_ids`` is hidden."""
        hidden = self._hidden_ids
        if not len(hidden):
            return None
        shown = token_ids != hidden[0] if len(hidden) == 1 else ~np.isin(token_ids, hidden)
        return None if shown.all() else shown

    def _accept_rows(self, rows: list[tuple[int, RequestHandle, int, int]], out: StepOutputs, now: float,
                     finishes: list, ended: list[int], ended_codes: list[Finish]) -> int:
        """``_accept`` each of ``rows`` (the token's index in ``out.token_ids``, handle, token, finish code); a
        request whose processing raises fails alone, one that a stop string ends is reported in ``ended``. Returns
        the tokens dropped after such an end in the same step (a speculative row's later tokens): they are not
        output tokens."""
        with_logprobs = _by_token(out.logprobs)
        stopped_here: set[int] = set()  # a speculative step lists several tokens of a request: none after its stop
        dropped = 0
        for i, handle, token, code in rows:
            if handle.seq in stopped_here:
                dropped += 1
                continue
            try:
                logprobs = with_logprobs(i, token) if with_logprobs is not None else None
                stopped = self._accept(handle, token, code, now, finishes, logprobs)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                self._fail(handle, exc, now)
                ended.append(handle.seq)
                ended_codes.append(Finish.ERROR)
                stopped_here.add(handle.seq)
                continue
            if stopped:
                stopped_here.add(handle.seq)
                ended.append(handle.seq)
                ended_codes.append(Finish.STOP_STRING)
        return dropped

    def _accept(self, handle: RequestHandle, token: int, code: int, now: float, finishes: list,
                logprobs: Logprobs | None = None) -> bool:
        """Append one token (``code``: its ``Finish`` as a plain int) and its logprobs if the request asked;
        True if a stop string ended the request.

        The hot path of the frontend: one call per request per step, so it avoids enum construction and
        per-call allocations where nothing is to be matched.
        """
        if handle.metrics.first_token_time is None:
            handle.metrics.first_token_time = now
        handle.token_ids.append(token)
        if logprobs is not None and handle.logprobs is not None:
            handle.logprobs.extend(logprobs)
        emitted = ""
        if (code != _STOP_TOKEN or handle.include_stop_token) and handle.has_text and token not in self._hidden:
            emitted = handle.detokenizer.push(token)
            if handle.stops.active:
                feed = handle.stops.feed(emitted, len(handle.token_ids) > handle.min_tokens)
                emitted = feed.emit
                if feed.stopped:
                    self._emit(handle, emitted, [token], logprobs)
                    finishes.append((handle, ("stop", feed.matched, now)))
                    return True
        if code == _NONE:
            self._emit(handle, emitted, [token], logprobs)
        else:
            finish = Finish(code)
            stop_reason = token if finish is Finish.STOP_TOKEN else None
            self._flush(handle, emitted, [token], finishes, (finish.reason, stop_reason, now), logprobs)
        return False

    def _prompt_logprobs(self, columns: LogprobColumns) -> None:
        """Append each request's scored prompt positions (entries of one request are consecutive)."""
        seqs = columns.rows
        bounds = np.flatnonzero(np.diff(seqs)) + 1
        for lo, hi in zip(np.concatenate([[0], bounds]).tolist(), np.concatenate([bounds, [len(seqs)]]).tolist()):
            handle = self._handles.get(int(seqs[lo]))
            if handle is None or handle.prompt_logprobs is None:
                continue
            handle.prompt_logprobs.extend(_logprobs(columns, lo, hi, columns.token_ids[lo:hi].tolist()))

    def _flush(self, handle: RequestHandle, emitted: str, token_ids: list[int], finishes: list, args: tuple,
               logprobs: Logprobs | None = None) -> None:
        """The request ends: emit what the detokenizer and the stop matcher still hold, then finish (a
        ``text_by_caller`` request's text is left to its caller: ``undecoded``)."""
        if handle.text_by_caller:
            handle.undecoded = True
        elif handle.has_text:
            emitted += handle.stops.feed(handle.detokenizer.finish(),
                                         len(handle.token_ids) > handle.min_tokens).emit + handle.stops.flush()
        self._emit(handle, emitted, token_ids, logprobs)
        finishes.append((handle, args))

    def _fail(self, handle: RequestHandle, exc: Exception, now: float) -> None:
        """Detokenizing or streaming this request raised: it fails alone; the core frees it."""
        if not handle.finished:
            handle.finish("error", None, now, error=f"output processing failed: {exc!r}")
        self._handles.pop(handle.seq, None)
        self._log.untrack(handle.seq)

    @staticmethod
    def _emit(handle: RequestHandle, text: str, token_ids: list[int], logprobs: Logprobs | None = None) -> None:
        if text:
            handle.text_pieces.append(text)
        if handle.streaming and (text or token_ids):
            prompt = None
            if handle.prompt_logprobs is not None and not handle.prompt_logprobs_streamed and token_ids:
                prompt, handle.prompt_logprobs_streamed = handle.prompt_logprobs.slice(0), True
            handle.deltas.put(StreamDelta(handle.request_id, text, token_ids, logprobs=logprobs,
                                          prompt_logprobs=prompt))


def _logprobs(columns: LogprobColumns, lo: int, hi: int, token_ids: list[int]) -> Logprobs:
    """Entries ``lo:hi`` of ``columns`` as ``Logprobs`` (each entry's top list cut to what it asked for)."""
    ks = columns.k[lo:hi].tolist()
    top_ids, top_lps = columns.top_ids[lo:hi].tolist(), columns.top_logprobs[lo:hi].tolist()
    return Logprobs(token_ids, columns.chosen[lo:hi].tolist(), columns.ranks[lo:hi].tolist(),
                    [ids[:k] for ids, k in zip(top_ids, ks)], [lps[:k] for lps, k in zip(top_lps, ks)])


def _by_token(columns: LogprobColumns | None) -> Callable[[int, int], Logprobs | None] | None:
    """``(token index in the step's token_ids, the token) -> Logprobs`` of that one token, for the tokens
    ``columns`` has (one token a row: the index is the output row)."""
    if columns is None:
        return None
    at = {row: i for i, row in enumerate(columns.rows.tolist())}

    def lookup(row: int, token: int) -> Logprobs | None:
        i = at.get(row)
        return None if i is None else _logprobs(columns, i, i + 1, [token])

    return lookup
