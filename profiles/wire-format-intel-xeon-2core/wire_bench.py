"""A step's outputs on the core -> frontend pipe: pickle (before) against ``step_wire`` (after), side by side.

    python profiles/wire-format-intel-xeon-2core/wire_bench.py

Per message size (rows of a decode step, one token each, a StepRecord, three first-scheduled seqs): the
median microseconds of the sender's part (``pickle.dumps`` / ``step_wire.encode``, then the whole
``Connection.send`` / ``send_bytes`` into a pipe drained by another thread) and of the receiver's part
(``pickle.loads`` / ``step_wire.decode``), interleaved in rounds so that machine load hits both alike.
"""

from __future__ import annotations

import pickle
import statistics
import sys
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from asyncbatch.engine import step_wire  # noqa: E402
from asyncbatch.engine.messages import StepOutputs  # noqa: E402
from asyncbatch.profiling.timeline import StepRecord  # noqa: E402


def message(rows: int) -> StepOutputs:
    return StepOutputs(5, np.arange(rows, dtype=np.int64), np.arange(rows, dtype=np.int64) + 1000,
                       np.zeros(rows, np.int8), np.zeros(0, np.int64), np.zeros(0, np.int8), np.arange(3),
                       StepRecord(5, rows, rows, 0, rows, *[1.5] * 10))


def median_us(fn, n: int = 2000) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    a, b = Pipe()
    drain = threading.Thread(target=lambda: [b.recv_bytes() for _ in iter(int, 1)], daemon=True)
    drain.start()
    print("| rows | pickle dumps | step_wire encode | send (pickle) | send_bytes (step_wire) | pickle loads | "
          "step_wire decode | bytes pickle / step_wire |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in (256, 1024, 4096):
        o = message(rows)
        pickled, flat = pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL), step_wire.encode(o)
        figures: dict[str, list[float]] = {}
        for _ in range(3):
            for name, fn in (("dumps", lambda: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)),
                             ("encode", lambda: step_wire.encode(o)),
                             ("send", lambda: a.send(o)),
                             ("send_bytes", lambda: a.send_bytes(step_wire.encode(o))),
                             ("loads", lambda: pickle.loads(pickled)),
                             ("decode", lambda: step_wire.decode(flat))):
                figures.setdefault(name, []).append(median_us(fn))
        m = {k: statistics.median(v) for k, v in figures.items()}
        print(f"| {rows} | {m['dumps']:.1f} | {m['encode']:.1f} | {m['send']:.1f} | {m['send_bytes']:.1f} | "
              f"{m['loads']:.1f} | {m['decode']:.1f} | {len(pickled)} / {len(flat)} |")


if __name__ == "__main__":
    main()
