"""``kill -USR1 <pid>`` writes every thread's Python stack to the process's stderr.

For a server or an engine core that stops making progress without failing: the
stacks say which thread waits on what, without a debugger or py-spy on the
machine, and the process goes on running. ``asyncbatch serve`` and every engine
core process register it at start (the default action of SIGUSR1 would end the
process instead). Python's ``faulthandler`` writes the stacks from the signal
handler itself, so a thread holding the GIL forever is dumped too.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # POSIX only


def dump_stacks_on_signal() -> bool:
    """Register the dump on ``DUMP_SIGNAL`` (where the platform has it); True if registered."""
    if DUMP_SIGNAL is None or not hasattr(faulthandler, "register"):
        return False
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    return True
