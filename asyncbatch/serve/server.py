"""Running the application: uvicorn on one socket, and a drain on SIGTERM that exits 0.

    SIGTERM ─► draining: /health 503, new requests 503, listening socket closed (uvicorn)
               in-flight requests go on ─────────────► all done: exit 0
                                 └─ shutdown_timeout passes first: abort them (streams end with
                                    finish_reason "abort" and [DONE]), then exit 0

A second SIGINT forces uvicorn to quit at once (its Ctrl-C convention). SIGUSR1 writes every thread's stack
to stderr, passes the signal on to the engine core process (which does the same) and changes nothing else
(``profiling.stack_dump``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import uvicorn

from asyncbatch.profiling.stack_dump import dump_stacks_on_signal
from asyncbatch.serve.app import build_app
from asyncbatch.serve.engine_protocol import AsyncEngineClient
from asyncbatch.serve.settings import ServeSettings
from asyncbatch.serve.state import ServerState

log = logging.getLogger("asyncbatch.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: the first stop signal starts the drain and arms the abort timer."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._timer: asyncio.TimerHandle | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        first = not self.state.draining
        self.state.draining = True
        super().handle_exit(sig, frame)
        if first:
            loop = asyncio.get_event_loop()
            timeout = self.state.settings.shutdown_timeout_s
            log.info("stop signal %d: draining %d in-flight requests (up to %.0f s)", sig,
                     self.state.engine.num_requests()[0], timeout)
            loop.call_soon_threadsafe(self._arm, loop, timeout)

    def _arm(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._timer = loop.call_later(timeout, abort_all, self.state)


def abort_all(state: ServerState) -> None:
    """Abort every unfinished request; their responses end normally with ``finish_reason="abort"``."""
    aborted = state.engine.abort_all()
    if aborted:
        log.warning("shutdown timeout: aborting %d in-flight requests", aborted)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before the engine loads, so a busy port fails in a second, not after loading a model."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port") from exc
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app, settings: ServeSettings, log_level: str, access_log: bool) -> uvicorn.Config:
    # The engine aborts stragglers at shutdown_timeout; uvicorn's own limit is only the last resort.
    return uvicorn.Config(app, lifespan="off", log_level=log_level, access_log=access_log,
                          timeout_graceful_shutdown=settings.shutdown_timeout_s + 5.0, timeout_keep_alive=5)


def run_server(engine: AsyncEngineClient, settings: ServeSettings, sock: socket.socket, log_level: str = "info",
               access_log: bool = False) -> int:
    """Serve until a stop signal; returns 0 after a clean drain. The caller closes ``engine``."""
    app, state = build_app(engine, settings)
    server = DrainingServer(uvicorn_config(app, settings, log_level, access_log), state)
    # uvicorn re-raises the stop signal once it has shut down; with the default handler that would kill
    # the process with the signal's status instead of the 0 a finished drain deserves.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    dump_stacks_on_signal()  # kill -USR1: every thread's stack to stderr, the server goes on
    host, port = sock.getsockname()[:2]
    print(f"asyncbatch serve: {settings.served_model_names[0]} on http://{host}:{port} "
          f"(OpenAI API under /v1; /health, /metrics)", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
