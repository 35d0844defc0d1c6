"""Which thread runs the CPU kernels, and with how many OpenMP threads.

PyTorch parallelises its CPU kernels with OpenMP, and GNU OpenMP (libgomp, in
the Linux wheels) gives every thread that opens a parallel region a pool of
worker threads of its own. When the pools of two threads together hold more
threads than the machine has cores, libgomp stops letting idle workers spin
between parallel regions and parks them in the kernel instead, so each of the
~1,000 parallel regions of a decode step pays a wake-up. An engine used to
load its model on one thread and run its steps on another, and so ran every
step that way. Measured on a 2-core Xeon, SmolLM2-135M in bfloat16, one row
(``profiles/cpu-kernel-threads-intel-xeon-2core``): the bare step 32-33 ms when
one thread runs every kernel, 48-49 ms when another thread loaded the model
with a pool of its own; in the engine 55.7 ms before this module, 34.8 after.

So on the ``cpu`` device the device thread is the only thread of the engine
that runs kernels on more than one OpenMP thread:

    build thread                 device thread                  planner thread
    one_kernel_thread():
      load weights, KV cache
    (its own setting restored)
                                 claim_kernel_threads(n)        one_kernel_thread_here()
                                 compile warm-up, every step    numpy, small torch ops

``torch.set_num_threads`` also sets a process-wide default that threads which
have not chosen pick up on their first parallel kernel, so each engine thread
sets its own count before it runs any kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_kernel_thread() -> Iterator[None]:
    """Run the block's CPU kernels on the calling thread alone (no OpenMP pool is made for it), then give the
    thread back the count it had: loading a model this way leaves the device thread the only pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def claim_kernel_threads(num_threads: int) -> None:
    """Called first on the thread that will run every step's kernels (the device thread)."""
    torch.set_num_threads(num_threads)


def one_kernel_thread_here() -> None:
    """Called first on an engine thread that runs no heavy kernels (the planner): any small torch op it runs
    stays on it instead of opening a second pool."""
    torch.set_num_threads(1)
