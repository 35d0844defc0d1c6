"""The simulated device thread wakes on time: its step must end when its model says, not when the OS says.

``time.sleep`` returns late: the kernel's timer slack (50 us by default) plus the
hypervisor's timer path; on a 2-core Intel VM the median was 150 us after a
0.8 ms sleep, 97 us with the slack at 1 us. A simulated step's result reaching
the planner that late is host latency a real device does not have (its queue
ends the step on time), and at 1 ms steps it sits on the planner's critical
path (``engine/core.py``). So the simulated device's thread sleeps with its
timer slack at 1 us where Linux allows it.

Not done: waking early and spinning to the deadline. With the GIL released on
every turn (``os.sched_yield``) the spin still asks for the GIL back each time,
and with grammar rows it lands while the planner applies tokens and fills masks:
measured, the planner's chain got longer (result latency 0.44-0.46 -> 0.50-0.69 ms),
though a step without grammar rows was answered 0.1 ms sooner.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_TIMERSLACK = 29


def set_thread_timer_slack(ns: int) -> bool:
    """The calling thread's timer slack (Linux ``prctl``); False where it cannot be set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def fine_timer_slack() -> None:
    """Timer slack 1 us for the calling thread (the sim's device thread calls it when it starts)."""
    set_thread_timer_slack(1000)
