"""``asyncbatch serve --replicas 2`` as users run it: a child process that starts its own Ray, shows per-replica
and prefix-cache series in the ingress's ``/metrics``, drains on SIGTERM or SIGINT, exits 0 and leaves no
process behind.

A Ray server start costs most of a minute on 2 cores, so each start checks as much as it can. This module's
start covers the other signal sent twice (Ctrl-C twice: the second aborts at once), the pow2 router's
per-replica series and the processes, with ``--no-engine-process``, which halves the processes to start (the
engine core in the replica's process; the replica code is the same). The SIGTERM drain (requests, the metrics
changing as they arrive, a stream that finishes and streams aborted at the timeout, refusal while draining,
the processes, with each replica's engine core in its own process as users run it) is checked at the end of
``test_cluster_ray``, on the server that module's tests use.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

pytest.importorskip("ray", reason="the cluster extra is not installed (pip install -e '.[cluster]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[serve]')")
pytest.importorskip("psutil", reason="the cluster extra is not installed (pip install -e '.[cluster]')")

from tests.cluster_harness import (
    PREFIX,
    ProcessWatch,
    cluster_server,
    per_replica,
    start_streams,
    stop_and_check,
    total,
    wait_metrics,
)


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
        wait_metrics(url, "a request running", lambda m: total(m, "asyncbatch:num_requests_running") == 1)
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
