"""The engine core's process: build the engine, then forward the frontend's messages to the planner.

    main thread      recv ──► EngineCore.inbox        (until Shutdown, EOF, or the planner has died)
    planner thread   plan, launch, apply ──► conn.send(StepOutputs | Reply | CoreFailed)
    device thread    (cpu / sim backends) runs the steps

Importing this module imports the engine (torch, the executors, the model
code): the fork server preloads it once, so every core after the first starts
by a fork of an interpreter that has already paid for those imports.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import signal
import traceback
from multiprocessing.connection import Connection

import asyncbatch.executors.sim_executor
import asyncbatch.executors.torch_executor  # noqa: F401 - preloaded by the fork server
from asyncbatch.config import EngineConfig
from asyncbatch.engine.builder import ModelSpec, build_core
from asyncbatch.engine.messages import CoreFailed, CoreReady, Shutdown
from asyncbatch.profiling.marks import enable_nvtx

_POLL_S = 0.5
# transformers imports a model type's config module on first use (about 2 s here): pay it once, in the
# fork server, for the families the engine runs.
_CONFIG_MODULES = ("llama", "mistral", "qwen2", "qwen3")
for _name in _CONFIG_MODULES:
    with contextlib.suppress(ImportError):
        importlib.import_module(f"transformers.models.{_name}.configuration_{_name}")  # how often the main thread checks that the planner is still alive


def core_main(config: EngineConfig, spec: ModelSpec, conn: Connection) -> None:
    """Entry point of the core process (``multiprocessing`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller, who closes us
    enable_nvtx(spec.nvtx)
    try:
        core = build_core(config, spec, conn.send)
    except BaseException as exc:  # noqa: BLE001 - reported to the frontend, which raises it
        conn.send(CoreFailed(repr(exc), traceback.format_exc()))
        return
    conn.send(CoreReady(core.scheduler.blocks.num_usable_blocks, core.executor.describe()))
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
