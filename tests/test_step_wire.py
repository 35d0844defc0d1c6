"""``step_wire``: a step's outputs cross the pipe as one flat buffer and come back field for field."""

from __future__ import annotations

import dataclasses
import pickle
from multiprocessing import Pipe

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncbatch.engine import step_wire
from asyncbatch.engine.control import Reply
from asyncbatch.engine.messages import CoreFailed, CoreReady, Finish, LogprobColumns, StepOutputs, ended_only
from asyncbatch.profiling.timeline import StepRecord


def assert_same(got: StepOutputs, want: StepOutputs) -> None:
    for f in dataclasses.fields(StepOutputs):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.flags.writeable, f.name
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        elif isinstance(b, LogprobColumns):
            for g in dataclasses.fields(LogprobColumns):
                x, y = getattr(a, g.name), getattr(b, g.name)
                assert (x is None) == (y is None), g.name
                if y is not None:
                    np.testing.assert_array_equal(x, y, err_msg=g.name)
        elif isinstance(b, StepRecord):
            assert dataclasses.astuple(a) == dataclasses.astuple(b)
        else:
            assert a == b, f.name


def a_record(step_id: int) -> StepRecord:
    """A record whose every field differs from its default (a field the codec dropped would show)."""
    record = StepRecord(step_id)
    for i, f in enumerate(dataclasses.fields(StepRecord)):
        if f.name != "step_id":
            value = getattr(record, f.name)
            setattr(record, f.name, (not value) if isinstance(value, bool) else type(value)(i + 0.25))
    return record


def columns(n: int, k: int, prompt: bool) -> LogprobColumns:
    rng = np.random.default_rng(n)
    return LogprobColumns(np.arange(n, dtype=np.int64), np.full(n, k, dtype=np.int64),
                          rng.standard_normal(n).astype(np.float32), np.arange(n, dtype=np.int64) + 1,
                          rng.integers(0, 1000, (n, k)), rng.standard_normal((n, k)).astype(np.float32),
                          np.arange(n, dtype=np.int64) * 3 if prompt else None)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 300), extra=st.integers(0, 40), ended=st.integers(0, 5), first=st.integers(0, 7),
       speculative=st.booleans(), with_record=st.booleans(), logprobs=st.booleans(), prompt=st.booleans(),
       step_id=st.integers(-1, 2**40))
def test_outputs_come_back_field_for_field(rows: int, extra: int, ended: int, first: int, speculative: bool,
                                           with_record: bool, logprobs: bool, prompt: bool, step_id: int) -> None:
    rng = np.random.default_rng(rows * 31 + extra)
    num_tokens = rng.integers(1, 5, rows) if speculative else None
    tokens = int(num_tokens.sum()) if speculative else rows
    outputs = StepOutputs(
        step_id, rng.integers(0, 2**40, rows), rng.integers(0, 2**17, tokens),
        rng.integers(0, len(Finish), rows).astype(np.int8), rng.integers(0, 2**40, ended),
        np.full(ended, Finish.ABORT, dtype=np.int8), rng.integers(0, 2**40, first),
        a_record(step_id) if with_record else None, columns(min(rows, extra), 3, False) if logprobs else None,
        columns(extra, 2, True) if prompt else None, num_tokens)
    data = step_wire.encode(outputs)
    assert data[:1] == step_wire.TAG
    assert_same(step_wire.loads(data), outputs)


def test_arrays_of_other_integer_types_travel_in_the_declared_dtypes() -> None:
    outputs = StepOutputs(3, np.arange(4, dtype=np.int32), np.arange(4, dtype=np.uint16), np.zeros(4, dtype=bool),
                          np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), np.arange(2, dtype=np.int32))
    got = step_wire.decode(step_wire.encode(outputs))
    assert [a.dtype for a in (got.seqs, got.token_ids, got.finish, got.ended_seqs, got.ended_codes,
                              got.first_scheduled)] == [np.int64, np.int64, np.int8, np.int64, np.int8, np.int64]
    np.testing.assert_array_equal(got.token_ids, np.arange(4))


def test_every_other_message_is_a_pickle_the_receiver_tells_apart() -> None:
    aborts = ended_only([4, 9], Finish.ABORT)
    for message in (CoreReady(12, {"name": "sim"}), CoreFailed("boom", "tb"), Reply.failed(7, ValueError("x"))):
        data = pickle.dumps(message)
        assert data[:1] != step_wire.TAG
        assert type(step_wire.loads(data)) is type(message)
    assert_same(step_wire.loads(step_wire.encode(aborts)), aborts)


def test_a_step_crosses_a_real_pipe() -> None:
    """What the core's sender and the frontend's receiver do: ``send_bytes`` of the buffer, ``recv_bytes``."""
    outputs = StepOutputs(7, np.arange(5), np.arange(5) + 100, np.zeros(5, dtype=np.int8), np.zeros(0, np.int64),
                          np.zeros(0, np.int8), np.arange(5), a_record(7), None, None, None)
    a, b = Pipe()
    a.send_bytes(step_wire.encode(outputs))
    a.send(CoreFailed("after it"))
    assert_same(step_wire.loads(b.recv_bytes()), outputs)
    assert step_wire.loads(b.recv_bytes()) == CoreFailed("after it")
