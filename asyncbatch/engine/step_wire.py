"""``StepOutputs`` on the pipe from the engine core to the frontend: one flat buffer, not a pickle.

    core: sender thread                                frontend: receiver thread
      encode(outputs) ── send_bytes ═══ pipe ═══► recv_bytes ── decode ──► StepOutputs
      every other message: pickled (Connection.send)        tag byte tells them apart

Every applied step crosses the process boundary once, so its encoding is paid
on the core's sender thread, whose GIL the planner shares, every step.
``Connection.send`` of a 256-row step (seven arrays and a ``StepRecord`` of 50
fields) took ~45 us on the 2-core Intel VM (multiprocessing's pickler, numpy's
``__reduce__`` per array, the dataclass's per-field state) and its unpickling
~17 us; here ~6.5 us (``send_bytes`` included) and ~4 us. The layout is a
fixed header, the arrays' bytes back to back in a fixed order and the record as
one ``struct``: a few ``tobytes`` and one ``pack``
(``profiles/wire-format-intel-xeon-2core/wire_bench.py``).

Invariants: ``decode(encode(o))`` equals ``o`` field for field (arrays in their
declared dtypes, writable, and the record's values); a message that is not
``StepOutputs`` never starts with ``TAG`` (a pickle starts with its PROTO
opcode, 0x80), so the receiver tells the two apart by the first byte. The
rare optional parts (logprob columns) ride along as a pickle at the end.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
import struct

import numpy as np

from asyncbatch.engine.messages import StepOutputs
from asyncbatch.profiling.timeline import StepRecord

TAG = b"S"
assert TAG != pickle.PROTO  # the receiver's test of the first byte relies on it

_STRUCT_CODES = {"int": "q", "float": "d", "bool": "?"}
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))
# Field types are strings under ``from __future__ import annotations``: a field of another type fails here, at
# import, rather than travelling wrong.
_RECORD = struct.Struct("<" + "".join(_STRUCT_CODES[f.type] for f in dataclasses.fields(StepRecord)))
_record_values = operator.attrgetter(*_RECORD_FIELDS)

# step_id, then the lengths: rows (seqs, finish, num_tokens), token_ids, ended, first_scheduled (first_cached);
# then the flags
_HEADER = struct.Struct("<cqqqqqB")
_HAS_RECORD, _HAS_NUM_TOKENS, _HAS_TAIL, _HAS_FIRST_CACHED = 1, 2, 4, 8
_I64, _I8 = np.dtype(np.int64), np.dtype(np.int8)


def encode(outputs: StepOutputs) -> bytes:
    """``outputs`` as one buffer (``decode`` reads it back)."""
    seqs = outputs.seqs.astype(_I64, copy=False)
    token_ids = outputs.token_ids.astype(_I64, copy=False)
    ended = outputs.ended_seqs.astype(_I64, copy=False)
    first = outputs.first_scheduled.astype(_I64, copy=False)
    flags = 0
    parts = [b"", seqs.tobytes(), token_ids.tobytes(), outputs.finish.astype(_I8, copy=False).tobytes(),
             ended.tobytes(), outputs.ended_codes.astype(_I8, copy=False).tobytes(), first.tobytes()]
    if outputs.num_tokens is not None:
        flags |= _HAS_NUM_TOKENS
        parts.append(outputs.num_tokens.astype(_I64, copy=False).tobytes())
    if outputs.first_cached is not None:
        flags |= _HAS_FIRST_CACHED
        parts.append(outputs.first_cached.astype(_I64, copy=False).tobytes())
    if outputs.record is not None:
        flags |= _HAS_RECORD
        parts.append(_RECORD.pack(*_record_values(outputs.record)))
    if outputs.logprobs is not None or outputs.prompt_logprobs is not None:
        flags |= _HAS_TAIL
        parts.append(pickle.dumps((outputs.logprobs, outputs.prompt_logprobs), protocol=pickle.HIGHEST_PROTOCOL))
    parts[0] = _HEADER.pack(TAG, outputs.step_id, len(seqs), len(token_ids), len(ended), len(first), flags)
    return b"".join(parts)


def decode(data: bytes) -> StepOutputs:
    """The ``StepOutputs`` that ``encode`` made ``data`` from. Its arrays are views of one private copy of
    ``data`` (writable, like an unpickled array's)."""
    buf = bytearray(data)
    _, step_id, rows, tokens, ended, first, flags = _HEADER.unpack_from(buf)
    at = _HEADER.size

    def take(dtype: np.dtype, count: int) -> np.ndarray:
        nonlocal at
        array = np.frombuffer(buf, dtype, count, at)
        at += count * dtype.itemsize
        return array

    seqs, token_ids, finish = take(_I64, rows), take(_I64, tokens), take(_I8, rows)
    ended_seqs, ended_codes, first_scheduled = take(_I64, ended), take(_I8, ended), take(_I64, first)
    num_tokens = take(_I64, rows) if flags & _HAS_NUM_TOKENS else None
    first_cached = take(_I64, first) if flags & _HAS_FIRST_CACHED else None
    record = None
    if flags & _HAS_RECORD:
        record = StepRecord(*_RECORD.unpack_from(buf, at))
        at += _RECORD.size
    logprobs = prompt_logprobs = None
    if flags & _HAS_TAIL:
        logprobs, prompt_logprobs = pickle.loads(memoryview(buf)[at:])
    return StepOutputs(step_id, seqs, token_ids, finish, ended_seqs, ended_codes, first_scheduled, record,
                       logprobs, prompt_logprobs, num_tokens, first_cached)


def loads(data: bytes) -> object:
    """A message from the engine core: ``decode``'s buffer or a pickle."""
    return decode(data) if data[:1] == TAG else pickle.loads(data)
