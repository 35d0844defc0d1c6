"""``asyncbatch serve --replicas 2`` as users run it: a child process that starts its own Ray, shows per-replica
and prefix-cache series in the ingress's ``/metrics``, drains on SIGTERM or SIGINT, exits 0 and leaves no
process behind.

A Ray server start costs most of a minute on 2 cores, so each start checks as much as it can: the SIGTERM
start covers requests, the metrics changing as they arrive, a stream that finishes and streams aborted at the
timeout, refusal while draining and the processes; the SIGINT start covers the other signal sent twice
(Ctrl-C twice: the second aborts at once), the pow2 router's per-replica series and the processes. The SIGTERM
start runs each replica's engine core in its own process, as users run it (the most processes to leave
behind); the SIGINT start uses ``--no-engine-process``, which halves the processes to start (the engine core in
the replica's process; the replica code is the same).
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("ray", reason="the cluster extra is not installed (pip install -e '.[cluster]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[serve]')")
psutil = pytest.importorskip("psutil", reason="the cluster extra is not installed (pip install -e '.[cluster]')")

from prometheus_client.parser import text_string_to_metric_families

from tests.serve_harness import ServeProcess, refuses_new_requests, session_pids, stream_ids

MODEL = "smollm2-135m"
READY = "replicas on Ray Serve"
PREFIX = [t + 3000 for t in range(8 * 16)]  # 8 full blocks
START_S = 240  # a loaded 2-core machine has taken 80 s
GONE_S = 20  # after the server's exit, its processes must be gone within this


def cluster_server(*args: str, step_ms: int = 10) -> ServeProcess:
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


def start_streams(url: str, n: int, max_tokens: int, prompt: list[int]) -> tuple[list, list[threading.Thread]]:
    results: list = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "return_token_ids": True}
    threads = [threading.Thread(target=stream_ids, args=(url, body, results)) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def stop_and_check(server: ServeProcess, watch: ProcessWatch, sig: int, exit_within_s: float,
                   again_after_s: float | None = None) -> str:
    """Send ``sig`` (and again after ``again_after_s``, while it still drains); the server refuses new
    requests, exits 0, and leaves no process. Returns its output."""
    watch.snapshot()
    server.proc.send_signal(sig)
    assert refuses_new_requests(server.url, within_s=10)
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


@pytest.mark.slow
def test_sigterm_drains_reports_replica_and_cache_metrics_and_leaves_no_process() -> None:
    server = cluster_server("--shutdown-timeout", "12", step_ms=20)
    watch = ProcessWatch(server)
    try:
        url = server.url
        before = wait_metrics(url, "both replicas in /metrics",
                              lambda m: len(per_replica(m, "asyncbatch:num_requests_running")) == 2)
        assert set(per_replica(before, "asyncbatch:prefix_cache_hit_rate")) == {"0", "1"}
        assert before[("asyncbatch:num_replicas", (("model_name", MODEL),))] == 2
        queries0 = total(before, "asyncbatch:prefix_cache_queries_total")
        hits0 = total(before, "asyncbatch:prefix_cache_hits_total")
        by_cache0 = before[("asyncbatch:router_decisions_total", (("model_name", MODEL), ("reason", "cache_hit")))]

        # A repeated long prefix: the router sends the repeats where it is cached, and that replica hits.
        for k in range(3):
            r = httpx.post(url + "/v1/completions", json={"prompt": PREFIX + [k], "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
        after = wait_metrics(url, "prefix-cache hits in /metrics",
                             lambda m: total(m, "asyncbatch:prefix_cache_hits_total") >= hits0 + 2 * 8 * 16)
        assert total(after, "asyncbatch:prefix_cache_queries_total") >= queries0 + 3 * len(PREFIX)
        assert max(per_replica(after, "asyncbatch:prefix_cache_hit_rate").values()) > 0
        assert after[("asyncbatch:router_decisions_total", (("model_name", MODEL), ("reason", "cache_hit")))] \
            >= by_cache0 + 2

        # In flight at the signal: one stream that ends within --shutdown-timeout (300 tokens at 20 ms a step:
        # 6 s, long enough to be seen running beside the others while a loaded machine starts streams and
        # answers scrapes in seconds), two that cannot (2,000 tokens: 40 s) and are aborted at it.
        short, short_threads = start_streams(url, 1, 300, [5, 6, 7])
        long, long_threads = start_streams(url, 2, 2000, [8, 9, 10])
        ingress = (("model_name", MODEL),)
        wait_metrics(url, "3 requests in flight, all started", lambda m: m[(
            "asyncbatch:ingress_requests_in_flight", ingress)] == 3 and m[("asyncbatch:ingress_requests_waiting",
                                                                          ingress)] == 0)
        running = wait_metrics(url, "the long requests running on the replicas",
                               lambda m: total(m, "asyncbatch:num_requests_running") >= 2)
        assert total(running, "asyncbatch:kv_cache_usage_perc") > 0
        start = time.monotonic()
        out = stop_and_check(server, watch, signal.SIGTERM, exit_within_s=60)
        for t in short_threads + long_threads:
            t.join(30)
    finally:
        watch.stop()
        server.kill()
    assert time.monotonic() - start < 60
    (ids, finishes, done), = short
    assert len(ids) == 300 and finishes == ["length"] and done, (len(ids), finishes, done)
    assert len(long) == 2
    for ids, finishes, done in long:  # ended properly: an abort finish and [DONE], not a cut connection
        assert 0 < len(ids) < 2000 and finishes == ["abort"] and done, (len(ids), finishes, done)
    assert "draining" in out and "2 aborted," in out, out[-3000:]


@pytest.mark.slow
def test_sigint_twice_aborts_at_once_and_leaves_no_process_with_the_pow2_router() -> None:
    # A drain that would wait 120 s for the stream; the second Ctrl-C ends it at once.
    server = cluster_server("--shutdown-timeout", "120", "--router", "pow2", "--no-engine-process")
    watch = ProcessWatch(server)
    try:
        url = server.url
        r = httpx.post(url + "/v1/completions", json={"prompt": PREFIX, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        # Ray's own router, registered: the replicas' series are there too (no cache-or-load decisions).
        seen = wait_metrics(url, "both replicas' queries in /metrics", lambda m: total(
            m, "asyncbatch:prefix_cache_queries_total") >= len(PREFIX) and len(
            per_replica(m, "asyncbatch:prefix_cache_queries_total")) == 2)
        assert not any(name == "asyncbatch:router_decisions_total" for name, _ in seen)
        results, threads = start_streams(url, 1, 2000, [8, 9, 10])
        # The ingress's own counts, read at the scrape: the replicas' gauges are published every 0.5 s, and
        # one published while the request above ran could pass for this stream before it reached the ingress.
        ingress = (("model_name", MODEL),)
        wait_metrics(url, "the stream in flight, with a token", lambda m: m[(
            "asyncbatch:ingress_requests_in_flight", ingress)] == 1 and m[("asyncbatch:ingress_requests_waiting",
                                                                          ingress)] == 0)
        start = time.monotonic()
        out = stop_and_check(server, watch, signal.SIGINT, exit_within_s=60, again_after_s=1.0)
        for t in threads:
            t.join(30)
    finally:
        watch.stop()
        server.kill()
    assert time.monotonic() - start < 60
    (ids, finishes, done), = results
    assert 0 < len(ids) < 2000 and finishes == ["abort"] and done, (len(ids), finishes, done)
    assert "second stop signal" in out and "1 aborted," in out, out[-3000:]
