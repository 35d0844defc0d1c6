"""``asyncbatch serve --replicas 2`` in a child process, for the tests that start one (``test_cluster_lifecycle``,
``test_cluster_ray``): the server, every process it starts (``ProcessWatch``), its ``/metrics`` as numbers, streams
in threads, and the stop-signal check (the server refuses new requests, exits 0 and leaves no process)."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_harness import ServeProcess, refuses_new_requests, session_pids, stream_ids

MODEL = "smollm2-135m"
READY = "replicas on Ray Serve"
PREFIX = [t + 3000 for t in range(8 * 16)]  # 8 full blocks
START_S = 240  # a loaded 2-core machine has taken 80 s
GONE_S = 20  # after the server's exit, its processes must be gone within this


def cluster_server(*args: str, step_ms: int = 10) -> ServeProcess:
    """Two ``sim`` replicas on a Ray the server starts (its own session: ``kill`` ends every process of it)."""
    return ServeProcess("--replicas", "2", "--max-model-len", "2048", "--num-kv-blocks",
                        "256", "--sim-step-ms", str(step_ms), *args, health_timeout_s=START_S, new_session=True,
                        ready_line=READY)


class ProcessWatch:
    """Every process the server started, seen while it ran (its process tree, polled) or sharing its
    session: what must be gone after it exits."""

    def __init__(self, server: ServeProcess) -> None:
        self.pid = server.proc.pid
        self.seen: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.snapshot()

    def snapshot(self) -> None:
        try:
            for p in psutil.Process(self.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def alive(self) -> list[str]:
        left = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.name()}({p.pid})")
            except psutil.Error:
                pass
        return left + [f"session({pid})" for pid in session_pids(self.pid) if pid not in self.seen]

    def wait_gone(self, within_s: float) -> list[str]:
        deadline = time.monotonic() + within_s
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def per_replica(sample: dict, name: str) -> dict[str, float]:
    return {dict(labels)["replica"]: v for (n, labels), v in sample.items() if n == name and "replica" in dict(labels)}


def wait_metrics(url: str, what: str, ready, within_s: float = 30.0) -> dict:
    """``metrics(url)`` once ``ready(metrics)`` holds (the replicas publish every 0.5 s)."""
    deadline = time.monotonic() + within_s
    while True:
        sample = metrics(url)
        if ready(sample):
            return sample
        if time.monotonic() > deadline:
            shown = {k: v for k, v in sample.items() if "replica" in dict(k[1]) or "ingress" in k[0]}
            raise AssertionError(f"{what}: not within {within_s:.0f} s; /metrics had {shown}")
        time.sleep(0.2)


def total(sample: dict, name: str) -> float:
    return sum(per_replica(sample, name).values())


def start_streams(url: str, n: int, max_tokens: int, prompt: list[int],
                  headers: dict | None = None) -> tuple[list, list[threading.Thread]]:
    results: list = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "return_token_ids": True}
    threads = [threading.Thread(target=stream_ids, args=(url, body, results, headers)) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def stop_and_check(server: ServeProcess, watch: ProcessWatch, sig: int, exit_within_s: float,
                   again_after_s: float | None = None, headers: dict | None = None) -> str:
    """Send ``sig`` (and again after ``again_after_s``, while it still drains); the server refuses new
    requests (sent with ``headers``: the API key, if it has one), exits 0, and leaves no process. Returns its
    output."""
    watch.snapshot()
    server.proc.send_signal(sig)
    assert refuses_new_requests(server.url, within_s=10, headers=headers)
    if again_after_s is not None:
        time.sleep(again_after_s)
        assert server.proc.poll() is None, "the server stopped draining before its timeout"
        server.proc.send_signal(sig)
    assert server.proc.wait(timeout=exit_within_s) == 0, server.output()[-4000:]
    watch.stop()
    left = watch.wait_gone(GONE_S)
    assert not left, f"processes the server started are still alive {GONE_S} s after it exited: {left}"
    assert len(watch.seen) >= 5  # it did start Ray (GCS, raylet, agents, workers): the check checked something
    return server.output()




def ray_address(server: ServeProcess) -> str:
    """The address of the Ray the server started (its GCS server's: the ``--gcs-address`` it gave Ray's own
    processes; the GCS server itself is started on port 0), for a test that joins it as a driver."""
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            for arg in p.cmdline():
                if arg.startswith("--gcs-address="):
                    return arg.split("=", 1)[1]
    raise AssertionError("the server started no Ray process that names its GCS address")
