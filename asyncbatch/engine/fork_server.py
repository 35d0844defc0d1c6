"""The fork server every engine core process starts from, and starting it before the caller's own imports.

The fork server is a fresh interpreter that imports the engine once (``core_preload``: torch, transformers,
the executors), then forks a core for each ``CoreClient``. That preload is as heavy as what a server or a
script imports for itself (about 6 s of CPU on a slow 2-core VM), and multiprocessing starts it only when
the first core does, after the caller's imports. A caller that knows it will start a core calls
``start_early`` first, so the two imports run on two cores side by side::

    caller     [start_early][imports: torch, transformers, fastapi ........][LLM(...)][core starts: a fork]
    fork server             [preload: torch, transformers, executors ...][waits]

This module imports nothing heavy, so calling it costs a few milliseconds.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import threading

PRELOAD = ["asyncbatch.engine.core_preload"]
_context = None
_lock = threading.Lock()


def process_context():
    """The fork server context, preloaded with the engine so each core starts by a cheap fork."""
    global _context
    with _lock:
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        return _context


def start_early() -> None:
    """Start the fork server now (if it is not running): its preload runs while the caller goes on. Returns
    at once; the first core to start waits for whatever of the preload is left."""
    process_context()
    multiprocessing.forkserver.ensure_running()
