"""A server on a free loopback port inside the test process (uvicorn on its own thread and loop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
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

from asyncbatch.profiling.stack_dump import DUMP_HEADER
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
    """``python -m asyncbatch serve --device sim ARGS`` on a free port, healthy when constructed.
    ``new_session``: the server leads its own session, so every process it starts can be found by its
    session id (``session_pids``) and ``kill`` ends them all."""

    def __init__(self, *args: str, health_timeout_s: float = 60.0, new_session: bool = False,
                 ready_line: str | None = None) -> None:
        # Imported here: fake_openai_server.py, run as a script, imports this module without scripts/ on
        # the path.
        from harness.common import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The server's temporary files (multiprocessing's pymp-* folders, which a killed process leaves behind)
        # go to a folder of its own that kill() removes. Short, under /tmp: Ray puts sockets below it.
        self.tmpdir = tempfile.mkdtemp(prefix="ab-serve-", dir="/tmp")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": self.tmpdir}
        # A file, not a pipe: a pipe nobody reads fills up with request log lines and blocks the server.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by kill(), after the process
        self.new_session = new_session
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncbatch", "serve", "--device", "sim", "--port", str(self.port),
             "--max-model-len", "8192", *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True, start_new_session=new_session)
        deadline = time.monotonic() + health_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited early:\n{self.kill()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200 and (
                        ready_line is None or ready_line in self.output()):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                out = self.kill()
                raise AssertionError(f"serve did not become ready within {health_timeout_s:.0f} s:\n{out[-4000:]}")
            time.sleep(0.1)

    def output(self) -> str:
        return read_shared_log(self.log)

    def dump_stacks(self, expect: int = 2, within_s: float = 10.0) -> None:
        """Ask the server for every thread's stack, its engine core's included (the server passes the signal
        on), into the log (``asyncbatch.profiling.stack_dump``): for a test that saw the server stop making
        progress. Returns once ``expect`` more dumps are in the log, or after ``within_s`` (a process whose
        GIL is never given back dumps nothing). Only the server is signalled: multiprocessing's forkserver and
        resource tracker, which are its children too, would die of SIGUSR1."""
        before = self.output().count(DUMP_HEADER)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + within_s
        while self.output().count(DUMP_HEADER) < before + expect and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> str:
        """Stop the server (if it still runs; with ``new_session``, everything in its session), remove its
        temporary folder, and return everything it printed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.new_session:
            for pid in session_pids(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.output()


def read_shared_log(log) -> str:
    """Everything written so far to a file that a child process writes as its stdout.

    The child's descriptor shares this one's file offset (it is a duplicate), so ``seek(0)`` and ``read()``
    here would move where the child writes next: a line written between the two overwrote the log's start.
    ``os.pread`` reads at an offset without moving it."""
    fd, chunks, at = log.fileno(), [], 0
    while chunk := os.pread(fd, 1 << 20, at):
        chunks.append(chunk)
        at += len(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _stat_fields(entry: str) -> list[str] | None:
    """``/proc/<entry>/stat`` after "pid (comm) ": state, ppid, pgrp, session, ...; None if it is gone."""
    try:
        with open(f"/proc/{entry}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def descendant_pids(pid: int) -> list[int]:
    """Live processes under ``pid`` (children, theirs, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None and fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc."""
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and (fields := _stat_fields(entry)) is not None and fields[0] != "Z"
            and int(fields[3]) == sid]


def sse_events(response: httpx.Response) -> list:
    """A server-sent-events body's ``data:`` payloads in order: each decoded from JSON, ``"[DONE]"`` as it is."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream_ids(url: str, body: dict, out: list, headers: dict | None = None) -> None:
    """POST a streamed completion; append (token ids, finish reasons, whether [DONE] came) to ``out``."""
    finishes, ids, done = [], [], False
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:]).get("choices", []):
                    ids += choice.get("token_ids", [])
                    if choice["finish_reason"]:
                        finishes.append(choice["finish_reason"])
    out.append((ids, finishes, done))


def refuses_new_requests(url: str, within_s: float) -> bool:
    """Once the drain began (``/health`` stops answering 200), a new request is refused: 503 while the
    listening socket closes, or no connection at all."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code != 200:
                break
        except httpx.HTTPError:
            break
        time.sleep(0.02)  # the signal may not have been handled yet
    else:
        return False
    try:
        response = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=2)
    except httpx.HTTPError:
        return True
    return response.status_code == 503
