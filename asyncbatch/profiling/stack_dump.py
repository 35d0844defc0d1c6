"""``kill -USR1 <pid>`` writes every thread's Python stack to the process's stderr.

For a server or an engine core that stops making progress without failing: the
stacks say which thread waits on what, without a debugger or py-spy on the
machine, and the process goes on running. ``asyncbatch serve`` and every engine
core process register it at start (the default action of SIGUSR1 would end the
process instead), and a process passes the signal on to the engine cores it
started (``add_child``): ``kill -USR1 <server pid>`` dumps the server and its core.

Invariant: the dump is taken under the GIL. A Python-level handler runs on the
main thread between bytecodes, so every other thread is parked where it gave up
the GIL and its frame chain holds still while it is read. ``faulthandler``'s own
``register`` reads the frames from inside the C signal handler while other
threads keep running; with a thread busy in Python (importing, building
pydantic models) that read follows freed frames and the process dies of SIGSEGV
(seen here on the first signal, with two such threads). The price: a thread that
never gives the GIL back holds this dump up too; ``py-spy dump --pid`` reads
stacks from outside for that case.

Delivery is CPython's: the handler runs when the main thread next executes Python (the engine core's main
thread wakes at least every 0.5 s, the server's event loop every 0.1 s), and now and then CPython loses a
signal whose C handler ran on another thread (python/cpython#75302, open; here, with two threads busy in
Python, five signals of about a thousand went unanswered in one probe, none of 3,300 in another): if no dump
comes within a second or two, send the signal again.

Each dump goes out in one ``write`` so that the dumps of a server and its core,
which share one stderr, do not interleave line by line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback

DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # POSIX only
DUMP_HEADER = "--- asyncbatch: stacks of"  # each dump's first line starts so (for tools that look for dumps)

_children: set[int] = set()  # pids that get the signal after this process has dumped


def dump_stacks_on_signal() -> bool:
    """Register the dump on ``DUMP_SIGNAL`` (where the platform has it); True if registered.

    Call it from the main thread (``signal.signal`` must)."""
    if DUMP_SIGNAL is None:
        return False
    signal.signal(DUMP_SIGNAL, _on_signal)
    return True


def add_child(pid: int) -> None:
    """Pass the dump signal on to ``pid`` (an engine core process this one started; it registers the dump
    itself). Remove it with ``remove_child`` before it is reaped: a reaped pid may name another process."""
    _children.add(pid)


def remove_child(pid: int) -> None:
    _children.discard(pid)


def format_stacks() -> str:
    """Every live thread's stack, most recent call last, headed by its name; the calling thread's included."""
    names = {t.ident: t for t in threading.enumerate()}
    frames = sys._current_frames()  # the documented way to read other threads' frames
    where = f"pid {os.getpid()} ({os.path.basename(sys.argv[0] or 'python')}) at {time.strftime('%H:%M:%S')}"
    lines = [f"{DUMP_HEADER} {len(frames)} threads of {where} ---\n"]
    for ident, frame in frames.items():
        thread = names.get(ident)
        if thread is None:
            label = "(not a threading.Thread)"
        else:
            label = f'"{thread.name}" daemon' if thread.daemon else f'"{thread.name}"'
        lines.append(f"Thread 0x{ident:x} {label}, most recent call last:\n")
        lines.extend(traceback.format_stack(frame))
        lines.append("\n")
    return "".join(lines)


def _on_signal(signum: int, frame: object) -> None:
    _write_all(format_stacks().encode("utf-8", "backslashreplace"))
    for pid in list(_children):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _write_all(data: bytes) -> None:
    try:
        fd = sys.stderr.fileno()
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr replaced by something without a file descriptor
        sys.stderr.write(data.decode("utf-8"))
        return
    while data:
        data = data[os.write(fd, data):]
