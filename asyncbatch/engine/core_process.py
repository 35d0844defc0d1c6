"""The engine core's process: build the engine, then forward the frontend's messages to the planner.

    main thread      recv ──► EngineCore.inbox        (until Shutdown, EOF, or the planner has died)
    planner thread   plan, launch, apply ──► outbox   (never blocks: a slow frontend cannot stall a launch)
    sender thread    outbox ──► conn.send(Reply | CoreFailed), send_bytes(StepOutputs: ``step_wire``)
    device thread    (cpu / sim backends) runs the steps

A frontend slower than the device (its detokenization, or a caller hogging its
GIL) makes the outbox grow instead of blocking the planner on a full pipe: the
device keeps running and the outputs reach the frontend as fast as it reads them.

The fork server preloads ``core_preload`` (this module, the executors, the
model families' config modules, torch._dynamo) once, so every core after the
first starts by a fork of an interpreter that has already paid for those
imports; the frontend importing this module pays for none of them. A fork of
the server inherits the server's environment, frozen when the first core
started, so the caller sends its own and the core adopts it before anything
reads a setting (``ASYNCBATCH_DECODE_KERNEL`` set between two engines once
reached only the first).
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import threading
import traceback
from multiprocessing.connection import Connection

from asyncbatch.config import EngineConfig
from asyncbatch.engine import step_wire
from asyncbatch.engine.builder import ModelSpec, build_core
from asyncbatch.engine.messages import CoreFailed, CoreReady, Shutdown, StepOutputs
from asyncbatch.profiling.marks import enable_nvtx
from asyncbatch.profiling.stack_dump import dump_stacks_on_signal

_POLL_S = 0.5  # how often the main thread checks that the planner is still alive


def core_main(config: EngineConfig, spec: ModelSpec, conn: Connection, environ: dict[str, str]) -> None:
    """Entry point of the core process (``multiprocessing`` target); ``environ``: the caller's environment
    when it started this core."""
    adopt_environment(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller, who closes us
    dump_stacks_on_signal()  # kill -USR1: every thread's stack to stderr (a core that stops making progress)
    enable_nvtx(spec.nvtx)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_loop, args=(outbox, conn), name="asyncbatch-core-sender", daemon=True)
    sender.start()
    try:
        core = build_core(config, spec, outbox.put)
    except BaseException as exc:  # noqa: BLE001 - reported to the frontend, which raises it
        outbox.put(CoreFailed(repr(exc), traceback.format_exc()))
        outbox.put(_STOP)
        sender.join(timeout=10)
        return
    outbox.put(CoreReady(core.scheduler.blocks.num_usable_blocks, core.executor.describe()))
    gc.collect()
    gc.freeze()  # the model and engine objects never become garbage: keep them out of every GC pass
    core.start()
    while core.alive:
        try:
            if not conn.poll(_POLL_S):
                continue
            message = conn.recv()
        except (EOFError, OSError):  # the frontend is gone
            core.inbox.put(Shutdown())
            break
        core.inbox.put(message)
        if isinstance(message, Shutdown):
            break
    core.join(timeout=60)
    outbox.put(_STOP)  # after everything the planner sent, CoreFailed included
    sender.join(timeout=10)


_STOP = object()


def adopt_environment(environ: dict[str, str]) -> None:
    """Make this process's environment ``environ``: the engine's settings read from variables
    (``ASYNCBATCH_*``, Triton's, CUDA's before it starts) are then the caller's of now, as for a spawned
    process, and not the fork server's of when it started."""
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)


def _send_loop(outbox: queue.SimpleQueue, conn: Connection) -> None:
    """Send the planner's messages in order. A message that cannot be encoded ends the engine for the frontend
    (``CoreFailed`` with the traceback), never this thread alone: the frontend would wait for outputs forever."""
    while (message := outbox.get()) is not _STOP:
        try:
            if type(message) is StepOutputs:  # one per step: a flat buffer, not a pickle (``step_wire``)
                conn.send_bytes(step_wire.encode(message))
            else:
                conn.send(message)
        except (OSError, EOFError, BrokenPipeError):  # the frontend is gone; the main thread stops the core
            return
        except BaseException as exc:  # noqa: BLE001 - reported to the frontend, which fails every caller
            try:
                conn.send(CoreFailed(f"the engine core could not send {type(message).__name__}: {exc!r}",
                                     traceback.format_exc()))
            except (OSError, EOFError, BrokenPipeError):
                pass
            return
