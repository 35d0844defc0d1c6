"""``asyncbatch serve`` as users run it: a child process that drains on SIGTERM and exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[serve]')")

from asyncbatch.profiling.stack_dump import DUMP_HEADER
from asyncbatch.serve.server import bind_socket
from tests.serve_harness import ROOT, ServeProcess, descendant_pids, refuses_new_requests, stream_ids


def run_streams(server: ServeProcess, n: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    results: list = []
    body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    threads = [threading.Thread(target=stream_ids, args=(server.url, body, results)) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def wait_running(server: ServeProcess, n: int, within_s: float = 20) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=5).text
        if f'asyncbatch:num_requests_running{{model_name="smollm2-135m"}} {float(n)}' in text:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests did not start running within {within_s} s")


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests_and_exits_0() -> None:
    server = ServeProcess("--sim-step-ms", "10", "--shutdown-timeout", "30")
    try:
        # About 3 s of 10 ms steps: long enough that none ends before the signal on a loaded machine (with
        # 1 s, one did once, under a full parallel suite run).
        results, threads = run_streams(server, 3, max_tokens=300)
        wait_running(server, 3)
        server.proc.send_signal(signal.SIGTERM)
        assert refuses_new_requests(server.url, within_s=10)
        for t in threads:
            t.join(30)
        assert server.proc.wait(timeout=30) == 0
        log = server.kill()
    finally:
        server.kill()
    assert len(results) == 3
    for ids, finishes, done in results:
        assert len(ids) == 300 and finishes == ["length"] and done, (len(ids), finishes, done)
    assert "draining 3 in-flight requests" in log
    assert log.count("finish=length") == 3  # one request log line each


@pytest.mark.slow
def test_sigterm_aborts_stragglers_after_the_timeout() -> None:
    server = ServeProcess("--sim-step-ms", "10", "--shutdown-timeout", "1")
    try:
        results, threads = run_streams(server, 2, max_tokens=5000)  # 50 s: longer than the timeout
        wait_running(server, 2)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=20) == 0
        assert time.monotonic() - start < 10
        for t in threads:
            t.join(10)
        log = server.kill()
    finally:
        server.kill()
    assert len(results) == 2
    for ids, finishes, done in results:  # ended properly: an abort finish and [DONE], not a cut connection
        assert 0 < len(ids) < 5000 and finishes == ["abort"] and done
    assert "aborting 2 in-flight requests" in log


def test_busy_port_is_a_one_line_error() -> None:
    sock = bind_socket("127.0.0.1", 0)
    sock.listen()
    try:
        proc = subprocess.run([sys.executable, "-m", "asyncbatch", "serve", "--device", "sim", "--port",
                               str(sock.getsockname()[1])], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    finally:
        sock.close()
    assert proc.returncode == 2, proc.stderr
    assert "cannot listen on" in proc.stderr and "Traceback" not in proc.stderr


def test_sigusr1_dumps_every_threads_stack_of_the_server_and_its_core_and_both_go_on() -> None:
    """``kill -USR1 <server pid>`` (``profiling.stack_dump``): the server's and, passed on, the engine core's
    threads' stacks reach the log, and every process under the server lives on and the server still answers;
    what a test that sees streams stop asks for before it kills the server."""
    server = ServeProcess("--sim-step-ms", "2")
    try:
        processes = [server.proc.pid, *descendant_pids(server.proc.pid)]  # core, forkserver, resource tracker
        server.dump_stacks()
        health = httpx.get(server.url + "/health", timeout=10).status_code
        out: list = []
        stream_ids(server.url, {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": True,
                                "return_token_ids": True}, out)
        alive = [pid for pid in processes if pid in (server.proc.pid, *descendant_pids(server.proc.pid))]
    finally:
        log = server.kill()
    (ids, finishes, done), = out
    assert health == 200 and len(ids) == 4 and finishes == ["length"] and done
    assert alive == processes and len(processes) >= 2
    server_dump, core_dump = log.split(DUMP_HEADER)[1:]
    assert "in run_server" in server_dump  # the server's main thread
    assert "in core_main" in core_dump and '"asyncbatch-core-sender" daemon' in core_dump  # main and sender
