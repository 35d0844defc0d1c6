"""A server on a free loopback port inside the test process (uvicorn on its own thread and loop)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn
from typing_extensions import Self

from asyncbatch.serve.app import build_app
from asyncbatch.serve.async_llm import AsyncLLM
from asyncbatch.serve.server import DrainingServer, bind_socket, uvicorn_config
from asyncbatch.serve.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]


class UvicornThread:
    """A uvicorn server on its own thread and event loop, serving a socket bound on 127.0.0.1 (a free
    port); ``with`` starts it and waits until it serves, leaving stops and joins it."""

    def __init__(self, server: uvicorn.Server, name: str = "serve-test") -> None:
        self.server = server
        self.sock = bind_socket("127.0.0.1", 0)
        host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{self.port}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"{self.thread.name} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class ServerThread(UvicornThread):
    """``with ServerThread(engine, settings) as server: server.url`` - stopped and joined on exit."""

    def __init__(self, engine: AsyncLLM, settings: ServeSettings) -> None:
        self.engine = engine
        app, self.state = build_app(engine, settings)
        super().__init__(DrainingServer(uvicorn_config(app, settings, "warning", False), self.state))


@contextlib.contextmanager
def serving(settings: ServeSettings | None = None, model: str | None = None, **engine_kwargs) -> Iterator[tuple]:
    """An engine and a server over it; both closed at the end. Yields (server, engine)."""
    engine = AsyncLLM(model, **engine_kwargs)
    try:
        with ServerThread(engine, settings or ServeSettings(("test-model",))) as server:
            yield server, engine
    finally:
        engine.close()


def wait_idle(engine: AsyncLLM, timeout: float = 30.0) -> None:
    """Until the engine has no unfinished request (aborts land within a step or two)."""
    deadline = time.monotonic() + timeout
    while engine.num_requests()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_requests()[0] == 0, f"{engine.num_requests()[0]} requests still unfinished"


def client(server: ServerThread, **kwargs) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, **kwargs)


class ServeProcess:
    """``python -m asyncbatch serve --device sim ARGS`` on a free port, healthy when constructed."""

    def __init__(self, *args: str) -> None:
        # Imported here: fake_openai_server.py, run as a script, imports this module without scripts/ on
        # the path.
        from harness.common import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A file, not a pipe: a pipe nobody reads fills up with request log lines and blocks the server.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by kill(), after the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncbatch", "serve", "--device", "sim", "--port", str(self.port),
             "--max-model-len", "8192", *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited early:\n{self.kill()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError("serve did not become healthy within 60 s")
            time.sleep(0.1)

    def kill(self) -> str:
        """Stop the server (if it still runs) and return everything it printed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.seek(0)
        return self.log.read()
