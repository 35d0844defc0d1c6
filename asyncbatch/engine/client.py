"""The frontend's connection to the engine core: a child process (the default) or a thread.

    caller's process                                          core process (engine_process=True)
      LLM.submit/abort ── send ══════ pipe ═══════════════►  main thread: recv ──► EngineCore.inbox
                                                                 planner thread: plan, launch, apply
      receiver thread ◄═════════════ pipe ═══════════════════ send(StepOutputs | Reply | CoreFailed)
        (StepOutputs as ``step_wire``'s flat buffer, the rest pickled)
        └─► on_message (the frontend's output processing: detokenize, stop strings, stream)

The core process is forked from a fork server that has imported the engine
once, so a new core starts in well under a second, inherits no thread of the
caller's, and shares no GIL with it. It ignores SIGINT (Ctrl-C is the caller's
to handle) and exits when its pipe closes, so a caller that dies takes its core
with it. A core that dies (even by ``kill -9``) closes the pipe: the receiver
thread sees EOF at once and reports ``EngineDeadError`` to every waiter. With
``engine_process=False`` the same ``EngineCore`` runs on a thread of this
process and the pipe is a pair of queues (debugging, and the side-by-side figure).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing.spawn as mp_spawn
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from asyncbatch.config import EngineConfig
from asyncbatch.engine import step_wire
from asyncbatch.engine.builder import ModelSpec, build_core
from asyncbatch.engine.control import Call, ControlCall, Reply
from asyncbatch.engine.core import EngineCore
from asyncbatch.engine.core_process import core_main
from asyncbatch.engine.fork_server import process_context
from asyncbatch.engine.messages import CoreFailed, CoreReady, Shutdown
from asyncbatch.errors import EngineDeadError
from asyncbatch.profiling import stack_dump

R = TypeVar("R")
_live: weakref.WeakSet[CoreClient] = weakref.WeakSet()
_preparation_lock = threading.RLock()  # one patched multiprocessing.spawn at a time (_without_main_module)
_CLOSED = object()  # ends the in-process receiver


@contextlib.contextmanager
def _without_main_module():
    """Start a child without re-importing the caller's ``__main__`` in it.

    ``multiprocessing`` re-imports the main script in every child so that targets defined there resolve;
    ours lives in this package, and a script without an ``if __name__ == "__main__"`` guard would start a
    second engine inside the first one's core. So the main module is left out of the child's preparation.
    """
    original = mp_spawn.get_preparation_data

    def prepare(name: str) -> dict:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    with _preparation_lock:
        mp_spawn.get_preparation_data = prepare
        try:
            yield
        finally:
            mp_spawn.get_preparation_data = original


class CoreClient:
    """Starts the core, forwards messages to it, and delivers its messages to ``on_message``.

    ``on_message`` runs on the receiver thread for every ``StepOutputs``; ``on_dead`` once, with an
    ``EngineDeadError``, if the core fails or disappears while the client is open.
    """

    def __init__(self, config: EngineConfig, spec: ModelSpec, on_message: Callable[[object], None],
                 on_dead: Callable[[BaseException], None]) -> None:
        self._on_message = on_message
        self._on_dead = on_dead
        self._send_lock = threading.Lock()
        self._calls: dict[int, list] = {}
        self._call_ids = itertools.count(1)
        self._closed = False
        self._dead: BaseException | None = None
        self.process = None
        self.core: EngineCore | None = None  # in-process mode only (tests and debugging reach into it)
        if config.engine_process:
            ctx = process_context()
            self._conn, child = ctx.Pipe(duplex=True)
            self.process = ctx.Process(target=core_main, args=(config, spec, child, dict(os.environ)),
                                       name="asyncbatch-core", daemon=True)
            with _without_main_module():
                self.process.start()
            child.close()  # only the child holds that end now: its death reads as EOF here
            self._send_raw = self._conn.send
            ready = self._recv_process()
            if isinstance(ready, CoreReady):  # its handler is in place: until then SIGUSR1 would end it
                stack_dump.add_child(self.process.pid)  # kill -USR1 on this process dumps the core's too
        else:
            self._outbox: queue.SimpleQueue = queue.SimpleQueue()
            self.core = build_core(config, spec, self._outbox.put)
            self._send_raw = self.core.inbox.put
            self.core.start()
            ready = CoreReady(self.core.scheduler.blocks.num_usable_blocks, self.core.executor.describe())
        if isinstance(ready, CoreFailed):
            self._reap()
            raise RuntimeError(f"the engine core failed to start: {ready.message}\n{ready.traceback}")  # noqa: TRY004
        self.ready: CoreReady = ready
        self._receiver = threading.Thread(target=self._receive, name="asyncbatch-output", daemon=True)
        self._receiver.start()
        _live.add(self)

    # -- sending -----------------------------------------------------------------
    def send(self, message: object) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine has failed; create a new LLM") from self._dead
        if self._closed:
            raise EngineDeadError("the engine is closed")
        with self._send_lock:
            try:
                self._send_raw(message)
            except (OSError, EOFError) as exc:
                raise EngineDeadError("the engine core is gone") from exc

    def call(self, call: ControlCall[R], timeout: float = 60.0) -> R:
        """Run ``call`` on the planner thread between two steps and return its reply (a ``call.reply_type``).

        An exception the core raised answering it is raised here as its own type (``engine.control``);
        ``EngineDeadError`` if the core dies first, ``TimeoutError`` if it does not answer in ``timeout`` s.
        """
        call_id = next(self._call_ids)
        slot: list = [threading.Event()]
        self._calls[call_id] = slot
        try:
            self.send(Call(call_id, call))
            if not slot[0].wait(timeout):
                raise TimeoutError(f"the engine core did not answer {call!r} within {timeout} s")
        finally:
            self._calls.pop(call_id, None)
        reply: Reply | BaseException = slot[1]
        if isinstance(reply, BaseException):
            raise reply
        return reply.result()

    # -- receiving -----------------------------------------------------------------
    def _recv_process(self) -> object:
        return step_wire.loads(self._conn.recv_bytes())

    def _receive(self) -> None:
        recv = self._recv_process if self.process is not None else self._outbox.get
        while True:
            try:
                message = recv()
            except (EOFError, OSError):
                if not self._closed:
                    code = self.process.exitcode if self.process is not None else None
                    self._die(EngineDeadError(f"the engine core process died (exit code {code})"))
                return
            except BaseException as exc:  # noqa: BLE001 - a message this frontend cannot read: every caller hears
                # (this thread is the only reader: were it to end quietly, every waiting caller would wait forever)
                self._die(EngineDeadError(f"a message from the engine core could not be read: {exc!r}"), cause=exc)
                return
            if message is _CLOSED:
                return
            if isinstance(message, Reply):
                slot = self._calls.get(message.call_id)
                if slot is not None:
                    slot.append(message)
                    slot[0].set()
            elif isinstance(message, CoreFailed):
                error = EngineDeadError(f"engine failed: {message.message}")
                error.__cause__ = RuntimeError(message.traceback)
                self._die(error)
                return
            else:
                try:
                    self._on_message(message)
                except BaseException as exc:  # noqa: BLE001 - the frontend itself broke: every caller hears
                    self._die(EngineDeadError(f"output processing failed: {exc!r}"), cause=exc)
                    return

    def _die(self, error: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        if self._dead is None:
            self._dead = error
        for slot in list(self._calls.values()):
            slot.append(error)
            slot[0].set()
        self._on_dead(error)

    @property
    def error(self) -> BaseException | None:
        return self._dead

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closed

    # -- lifetime ------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Stop the core (its in-flight steps finish), then the receiver; idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            with self._send_lock:
                self._send_raw(Shutdown())
        except (OSError, EOFError):
            pass  # already gone
        self._reap(timeout)
        if threading.current_thread() is not self._receiver:
            self._receiver.join(timeout)

    def _reap(self, timeout: float = 30.0) -> None:
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(2.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(2.0)
            stack_dump.remove_child(self.process.pid)  # reaped: its pid may name another process next
            self._conn.close()
        elif self.core is not None:
            self.core.join(timeout)
            self._outbox.put(_CLOSED)


@atexit.register
def _close_all() -> None:
    for client in list(_live):
        client.close(timeout=5.0)
