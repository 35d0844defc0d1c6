"""The output processor's token log (``frontend.token_log``) against processing every row one by one.

Two ``OutputProcessor``s get the same random steps: one logs the rows of
``token_only`` requests after their first token (the default), the other
(``log_tokens = False``) appends each row as it comes. Every request's final
output (ids, text, finish reason) and every streamed delta must agree, over
steps that finish requests (length, EOS, stop ids), end them without a token
(aborts), emit hidden ids (EOS under ``ignore_eos``) mid-output, carry several
tokens a row (a speculative step, which flushes the log first), and mix
``token_only`` requests with streamed ones, with and without a tokenizer; a
small ``max_steps`` makes the log flush whole often, and requests arrive
between steps as a server's do.
"""

from __future__ import annotations

import queue

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from tokenizers import decoders as tk_decoders

from asyncbatch.engine.messages import Finish, StepOutputs
from asyncbatch.frontend.detokenizer import IncrementalDetokenizer, NullDetokenizer
from asyncbatch.frontend.output_processor import OutputProcessor
from asyncbatch.frontend.request_handle import RequestHandle
from asyncbatch.frontend.stop_strings import StopStringMatcher
from asyncbatch.frontend.token_log import TokenLog
from asyncbatch.outputs import RequestMetrics
from asyncbatch.profiling.timeline import Timeline

VOCAB = 12
EOS = 2
_EMPTY = np.zeros(0, dtype=np.int64)


def _tokenizer() -> Tokenizer:
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = tk_decoders.WordPiece(prefix="##")  # joins words with spaces
    return tk


TOKENIZER = _tokenizer()


class Side:
    """One output processor and its handles."""

    def __init__(self, log_tokens: bool, max_steps: int) -> None:
        self.handles: dict[int, RequestHandle] = {}
        self.all: dict[int, RequestHandle] = {}
        self.sent: list[object] = []
        self.processor = OutputProcessor(self.handles, Timeline(), frozenset({EOS}), self.sent.append, False)
        self.processor.log_tokens = log_tokens
        self.processor._log = TokenLog(self.handles, frozenset({EOS}), max_steps)

    def add(self, seq: int, streaming: bool, text: bool) -> None:
        detok = IncrementalDetokenizer(TOKENIZER, [1, 3]) if text else NullDetokenizer()
        handle = RequestHandle(seq, f"r{seq}", None, [1, 3], detok, StopStringMatcher([], False),
                               RequestMetrics(0.0), streaming=streaming, deltas=queue.SimpleQueue())
        self.handles[seq] = self.all[seq] = handle

    def view(self) -> dict:
        out = {}
        for seq, handle in self.all.items():
            deltas = []
            while not handle.deltas.empty():
                d = handle.deltas.get()
                deltas.append((d.text, list(d.token_ids), d.finish_reason))
            o = handle.output
            out[seq] = (None if o is None else (o.token_ids, o.text, o.finish_reason, o.stop_reason),
                        handle.metrics.first_token_time is not None, deltas,
                        handle.finished)
        return out


@st.composite
def workloads(draw):
    """Steps of (arrivals, rows, ended): each live request gets at most one row a step."""
    num = draw(st.integers(1, 12))
    kinds = [(draw(st.booleans()) and draw(st.booleans()), draw(st.booleans())) for _ in range(num)]
    arrive = [draw(st.integers(0, 6)) for _ in range(num)]
    steps = []
    for step in range(draw(st.integers(1, 30))):
        runs = draw(st.integers(0, 3)) == 0  # a speculative step: 1-3 tokens a row
        rows = []
        for seq in range(num):
            if arrive[seq] <= step and draw(st.integers(0, 4)):
                tokens = [draw(st.integers(0, VOCAB - 1)) for _ in range(draw(st.integers(1, 3)) if runs else 1)]
                code = draw(st.sampled_from([Finish.NONE] * 8 + [Finish.LENGTH, Finish.EOS, Finish.STOP_TOKEN]))
                rows.append((seq, tokens, int(code)))
        ended = [seq for seq in range(num) if arrive[seq] <= step and draw(st.integers(0, 30)) == 0]
        steps.append((runs, rows, ended))
    return kinds, arrive, steps, draw(st.integers(1, 4))


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_logged_outputs_equal_row_by_row(workload) -> None:
    kinds, arrive, steps, max_steps = workload
    sides = [Side(True, max_steps), Side(False, max_steps)]
    finished: set[int] = set()
    for step, (runs, rows, ended) in enumerate(steps):
        for seq, at in enumerate(arrive):
            if at == step:
                for side in sides:
                    side.add(seq, *kinds[seq])
        rows = [r for r in rows if r[0] not in finished]
        ended = [seq for seq in ended if seq not in finished and seq not in {r[0] for r in rows}]
        finished.update(seq for seq, _, code in rows if code)
        finished.update(ended)
        out = StepOutputs(step, np.array([r[0] for r in rows], dtype=np.int64),
                          np.array([t for r in rows for t in r[1]], dtype=np.int64),
                          np.array([r[2] for r in rows], dtype=np.int8),
                          np.array(ended, dtype=np.int64), np.full(len(ended), int(Finish.ABORT), dtype=np.int8),
                          _EMPTY, num_tokens=np.array([len(r[1]) for r in rows], dtype=np.int64) if runs else None)
        for side in sides:
            side.processor.process(out)
    logged, reference = (side.view() for side in sides)
    assert logged == reference


def test_the_log_takes_the_rows_after_the_first_and_flushes_before_the_end() -> None:
    side = Side(True, 100)
    for seq in range(3):
        side.add(seq, streaming=seq == 2, text=True)
    log = side.processor._log

    def step(step_id: int, tokens: list[int], codes: list[int]) -> None:
        n = len(tokens)
        side.processor.process(StepOutputs(step_id, np.arange(n, dtype=np.int64), np.array(tokens, dtype=np.int64),
                                           np.array(codes, dtype=np.int8), _EMPTY, _EMPTY.astype(np.int8), _EMPTY))

    step(1, [4, 5, 6], [0, 0, 0])
    assert log.num_steps == 0  # the first tokens take the per-row path, which tracks seqs 0 and 1
    step(2, [7, EOS, 8], [0, 0, 0])
    step(3, [9, 10, 11], [0, 0, 0])
    assert log.num_steps == 2
    assert side.handles[0].token_ids == [4]  # the rest is logged, not appended
    step(4, [3, 4, 5], [int(Finish.LENGTH), 0, 0])  # seq 0 ends: flushed, then its last token
    out = side.all[0].output
    assert out.token_ids == [4, 7, 9, 3] and out.text == "w4 w7 w9 w3" and out.finish_reason == "length"
    step(5, [0, 6, 7], [0, int(Finish.LENGTH), int(Finish.LENGTH)])
    out = side.all[1].output
    assert out.token_ids == [5, EOS, 10, 4, 6] and out.text == "w5 w10 w4 w6"  # EOS kept in ids, not in text
    assert side.all[2].output.token_ids == [6, 8, 11, 5, 7]  # streamed: never logged


def test_tracking_survives_seqs_far_apart() -> None:
    side = Side(True, 100)
    log = side.processor._log
    for seq in (5, 70_000, 3_000_000):
        side.add(seq, streaming=False, text=False)
        log.track(seq)
    seqs = np.array([5, 70_000, 3_000_000, 9], dtype=np.int64)
    rest = log.log(seqs, np.array([4, 5, 6, 7], dtype=np.int64), np.zeros(4, dtype=np.int8))
    assert rest.tolist() == [False, False, False, True]
    log.untrack(5)
    log.flush()
    assert [side.handles[s].token_ids for s in (5, 70_000, 3_000_000)] == [[4], [5], [6]]
    assert len(log._flags) <= 8 * 1024 * 1024
    for seq in (70_000, 3_000_000):
        log.untrack(seq)
    log.track(3_000_001)  # inside the array: no rebase
    assert log._base == 5
    log.untrack(3_000_001)
    side.add(9_000_000, streaming=False, text=False)
    log.track(9_000_000)  # past the array: rebased at the oldest tracked seq, the ended span gone
    assert log._base == 9_000_000 and len(log._flags) == 1024
    assert log.log(np.array([9_000_000], dtype=np.int64), np.array([8], dtype=np.int64),
                   np.zeros(1, dtype=np.int8)).tolist() == [False]
