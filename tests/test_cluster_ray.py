"""Replicas on Ray Serve, through ``asyncbatch serve --replicas 2`` as users run it (2 ``sim`` replicas, each
engine core in its own process, a Ray the server starts): the ``openai`` client through the ingress gets one
engine's tokens; the cache-aware router keeps a repeated prefix on one replica; a replica killed under load
fails its streams clearly, is restarted, and routing recovers; the ingress applies the server's key and body
limit. The module's last test stops the server with SIGTERM: it drains, reports per-replica and prefix-cache
metrics, exits 0 and leaves no process behind.

A Ray server start costs most of a minute on 2 cores (every process imports the engine), so the module's
tests share one: the test process joins its Ray as a second driver (for deployment handles and
``ray.kill``), and the SIGTERM check runs last, after the others (and after the killed replica's
restart: nothing it started may be left either). ``test_cluster_lifecycle`` starts the other server (SIGINT
twice, the pow2 router).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the cluster extra is not installed (pip install -e '.[cluster]')")
openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install -e '.[serve]')")
pytest.importorskip("psutil", reason="the cluster extra is not installed (pip install -e '.[cluster]')")

from ray import serve
from ray._raylet import Config

from asyncbatch import LLM, SamplingParams
from asyncbatch.cluster import launch
from asyncbatch.cluster.frontend import ClusterEngine, FrontendModel
from asyncbatch.config import SimConfig
from asyncbatch.errors import RequestFailedError
from tests.cluster_harness import (
    MODEL,
    ProcessWatch,
    cluster_server,
    per_replica,
    ray_address,
    start_streams,
    stop_and_check,
    total,
    wait_metrics,
)
from tests.cluster_harness import PREFIX as DRAIN_PREFIX  # the SIGTERM check's: cached by no test before it
from tests.serve_harness import ServeProcess

STEP_MS = 20  # the SIGTERM check's streams are sized by it (module end)
SIM = SimConfig(step_fixed_ms=float(STEP_MS))  # the server's: --sim-step-ms, the rest SimConfig's defaults
# An engine as the server builds each replica's (its tokens are the reference), in this process.
ENGINE = {"device": "sim", "sim": SIM, "num_kv_blocks": 256, "max_model_len": 2048, "engine_process": False}
PREFIX = list(range(100, 100 + 8 * 16))  # 8 full blocks
KEY = "cluster-key"  # the ingress applies asyncbatch serve's --api-key
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 << 10
ALIVE_AFTER_KILL = 50  # chunks a surviving stream must still get after the first failure
STATS_PERIOD_S = launch.ClusterSpec().stats_period_s  # how often replicas publish (the server's default)


@dataclass
class Cluster:
    """The server, what it started, and this process's handle to its replicas (as a driver of its Ray)."""

    server: ServeProcess
    watch: ProcessWatch
    handle: object  # the replicas' deployment handle

    @property
    def root(self) -> str:
        return self.server.url

    @property
    def url(self) -> str:
        return self.server.url + "/v1"

    def leave_ray(self) -> None:
        """Disconnect this process from the server's Ray (before the server stops it)."""
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    server = cluster_server("--shutdown-timeout", "12", "--api-key", KEY, "--max-request-bytes", str(MAX_BODY),
                            step_ms=STEP_MS)
    watch = ProcessWatch(server)
    # The server's Ray checks a token (a new local Ray's default; ~/.ray/auth_token, the same user's); a driver
    # joining it by address sends it only when told to.
    mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray's config reads it again (as Ray does where it turns the token on itself)
    try:
        ray.init(address=ray_address(server), log_to_driver=False)
        yield Cluster(server, watch, serve.get_deployment_handle(launch.REPLICA_DEPLOYMENT, app_name=launch.APP_NAME))
    finally:
        ray.shutdown()
        if mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = mode
        Config.initialize("")
        watch.stop()
        server.kill()


def replica_stats(handle, want: int = 2, tries: int = 40) -> dict[int, dict]:
    """Each replica's ``stats`` by pid (calls without a prompt are routed by load, so asking a few times
    reaches every replica)."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        s = handle.stats.remote().result(timeout_s=10)
        seen[s["pid"]] = s
        if len(seen) >= want:
            break
    return seen


def test_openai_client_through_the_ingress_gets_one_engines_tokens(cluster):
    url = cluster.url
    api = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
    prompts = [[5, 6, 7, 8, 9] * 7, PREFIX + [1, 2, 3]]
    with LLM(**ENGINE) as llm:
        refs = [llm.generate([p], SamplingParams(max_tokens=12, seed=7 + i), use_tqdm=False)[0]
                for i, p in enumerate(prompts)]
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, seed=7 + i,
                                       extra_body={"return_token_ids": True})
        assert whole.choices[0].model_extra["token_ids"] == ref.token_ids
        assert whole.choices[0].text == ref.text
        assert whole.usage.completion_tokens == len(ref.token_ids)
        chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, seed=7 + i, stream=True,
                                             extra_body={"return_token_ids": True}))
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ref.token_ids
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=-1)


def test_a_repeated_long_prefix_stays_on_one_replica(cluster):
    url, handle = cluster.url, cluster.handle
    before = {pid: s["served"] for pid, s in replica_stats(handle).items()}
    api = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
    tenant = [t + 20000 for t in PREFIX]  # a prefix no other test sends
    for k in range(6):
        api.completions.create(model=MODEL, prompt=tenant + [k, k + 1], max_tokens=2)
        # The first inside one summary period, the rest 2.4 periods after the previous.
        time.sleep(0.05 if k < 3 else 2.4 * STATS_PERIOD_S)
    after = replica_stats(handle)
    served = sorted(after[pid]["served"] - before.get(pid, 0) for pid in after)
    assert served[-1] >= 6, f"requests per replica: {served}"
    hits = max(s["prefix"]["cached_tokens"] for s in after.values())
    assert hits >= 5 * 7 * 16  # the 5 later requests reused the 7 blocks before the last prompt token


def test_replica_kill_under_load_fails_clearly_restarts_and_recovers(cluster):
    url, handle = cluster.url, cluster.handle
    api = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)

    streaming = [asyncio.Event() for _ in range(8)]
    failed = asyncio.Event()  # a stream of the killed replica has failed: the kill has landed

    async def one(k: int) -> str:
        try:
            # 2,000 tokens at 20 ms a step: every stream is still running when the kill lands, however slowly a
            # loaded machine got them started. Once a stream of the killed replica has failed, a stream that
            # still gets ALIVE_AFTER_KILL chunks is on the surviving replica: it has proved that replica
            # still serves and hangs up (its request is aborted). How long the rest of its 2,000 tokens
            # would take on a loaded machine is not this test's subject; how long the actor takes to die
            # after ``ray.kill`` returns is not either (chunks are counted after the first failure).
            stream = await api.completions.create(model=MODEL, prompt=[7, k, 9] * 10, max_tokens=2000,
                                                  stream=True, extra_body={"ignore_eos": True})
            after_kill = 0
            async for _chunk in stream:
                streaming[k].set()
                after_kill += failed.is_set()
                if after_kill >= ALIVE_AFTER_KILL:
                    await stream.close()
                    return "ok"
            return "ended"  # all 2,000 tokens
        except openai.APIError as exc:
            failed.set()
            return f"error: {exc}"

    async def load_and_kill() -> list[str]:
        tasks = [asyncio.ensure_future(one(k)) for k in range(8)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), timeout=30)  # all have tokens
        victim = (await asyncio.to_thread(_replica_actor_names))[0]
        await asyncio.to_thread(ray.kill, ray.get_actor(victim, namespace="serve"), no_restart=False)
        try:
            await asyncio.wait_for(failed.wait(), timeout=60)
        except TimeoutError:
            pytest.fail("no stream failed within 60 s of killing a replica under load")
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    before = set(_replica_actor_names())
    results = asyncio.run(load_and_kill())
    errors = [r for r in results if r.startswith("error")]
    assert errors, f"killing a replica under load failed no stream: {results}"
    assert "ok" in results, f"no stream on the surviving replica kept streaming after the kill: {results}"
    assert all("replica died" in e for e in errors), errors  # a clear error, not a hang or a silent cut
    deadline = time.monotonic() + 90

    def replaced() -> bool:  # a new replica actor, and the application running with two again
        names = set(_replica_actor_names())
        return len(names) == 2 and names != before and _running_replicas() == 2

    while time.monotonic() < deadline and not replaced():
        time.sleep(0.5)
    assert replaced(), "Ray did not restart the killed replica"
    sync_api = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
    for k in range(4):
        assert sync_api.completions.create(model=MODEL, prompt=[3, k] * 20, max_tokens=4).choices[0].text is not None
    assert len(replica_stats(handle)) == 2


def _replica_actor_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if launch.REPLICA_DEPLOYMENT in a["name"] and a["namespace"] == "serve"]


def _running_replicas() -> int:
    app = serve.status().applications["asyncbatch"]
    dep = app.deployments[launch.REPLICA_DEPLOYMENT]
    return dep.replica_states.get("RUNNING", 0) if app.status == "RUNNING" else 0


class _FakeHandle:
    """A deployment handle whose ``generate.remote(request)`` returns ``stream()`` (no Ray)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, _request):
        return self._stream()


class _DiesFirst:
    """A stream that fails like a dead replica before any delta (the first time only)."""

    calls = 0

    def __init__(self, deltas) -> None:
        self._deltas = deltas
        _DiesFirst.calls += 1
        self._die = _DiesFirst.calls == 1

    def cancel(self) -> None:
        pass

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        if self._die:
            raise ray.exceptions.ActorDiedError()
        for d in self._deltas:
            yield d


def test_a_request_that_streamed_nothing_is_retried_and_one_that_did_fails_clearly():
    from asyncbatch.outputs import StreamDelta

    with LLM(**ENGINE) as llm:
        model = FrontendModel(llm.tokenizer, llm._spec, llm._usable_tokens)
    done = StreamDelta(request_id="a", text="x", token_ids=[1], finish_reason="length")

    async def drain(engine) -> list:
        (req,) = engine.submit_ids([[1, 2, 3]], [SamplingParams(max_tokens=1)], ["a"])
        return [d async for d in req]

    _DiesFirst.calls = 0
    assert [d.finish_reason for d in asyncio.run(drain(ClusterEngine(_FakeHandle(lambda: _DiesFirst([done])), model)))] == ["length"]
    _DiesFirst.calls = 0
    with pytest.raises(RequestFailedError, match="replica died after streaming 0"):
        asyncio.run(drain(ClusterEngine(_FakeHandle(lambda: _DiesFirst([done])), model, max_retries=0)))


def test_the_ingress_applies_the_servers_key_body_limit_and_routes(cluster):
    root = cluster.root
    auth = AUTH
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    with httpx.Client(base_url=root, timeout=30) as http:
        assert http.post("/v1/completions", json=body).status_code == 401
        assert http.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert http.get("/health").json() == {"status": "ok"}  # probes stay open
        too_big = http.post("/v1/completions", json={**body, "prompt": [1] * (MAX_BODY // 2)}, headers=auth)
        assert too_big.status_code == 413 and "exceeds the limit" in too_big.json()["error"]["message"]
        ok = http.post("/v1/completions", json=body, headers=auth)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert http.get("/v1/models", headers=auth).json()["data"][0]["id"] == MODEL
        assert http.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200
        assert "asyncbatch:request_success_total" in http.get("/metrics").text


def test_the_ingress_counts_requests_without_a_token_as_waiting():
    from asyncbatch.outputs import StreamDelta

    class _Stream:
        def cancel(self) -> None:
            pass

        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            yield StreamDelta(request_id="a", text="x", token_ids=[1])
            yield StreamDelta(request_id="a", text="y", token_ids=[2], finish_reason="length")

    with LLM(**ENGINE) as llm:
        model = FrontendModel(llm.tokenizer, llm._spec, llm._usable_tokens)
    engine = ClusterEngine(_FakeHandle(_Stream), model)

    async def run() -> list[tuple[int, int]]:
        reqs = engine.submit_ids([[1, 2, 3]] * 2, [SamplingParams(max_tokens=2)] * 2, ["a", "b"])
        seen = [engine.num_requests()]
        it = reqs[0].__aiter__()
        await it.__anext__()  # the first delta: no longer waiting
        seen.append(engine.num_requests())
        async for _ in it:
            pass
        seen.append(engine.num_requests())
        reqs[1].abort()  # leaving before any token frees its place too
        seen.append(engine.num_requests())
        return seen

    assert asyncio.run(run()) == [(2, 2), (2, 1), (1, 1), (0, 0)]


# Last: it stops the server the module's tests share (pytest runs a module's tests in file order).
@pytest.mark.slow
def test_sigterm_drains_reports_replica_and_cache_metrics_and_leaves_no_process(cluster):
    """Last in the module: it stops the server the tests above used (``--shutdown-timeout 12``, 20 ms steps)."""
    server, watch, url = cluster.server, cluster.watch, cluster.root
    cluster.leave_ray()  # this process's driver is not one the server's stop may wait for
    try:
        before = wait_metrics(url, "both replicas in /metrics",
                              lambda m: len(per_replica(m, "asyncbatch:num_requests_running")) == 2)
        assert set(per_replica(before, "asyncbatch:prefix_cache_hit_rate")) == {"0", "1"}
        assert before[("asyncbatch:num_replicas", (("model_name", MODEL),))] == 2
        queries0 = total(before, "asyncbatch:prefix_cache_queries_total")
        hits0 = total(before, "asyncbatch:prefix_cache_hits_total")
        by_cache0 = before[("asyncbatch:router_decisions_total", (("model_name", MODEL), ("reason", "cache_hit")))]

        # A repeated long prefix: the router sends the repeats where it is cached, and that replica hits.
        for k in range(3):
            r = httpx.post(url + "/v1/completions", json={"prompt": DRAIN_PREFIX + [k], "max_tokens": 2},
                           headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
        after = wait_metrics(url, "prefix-cache hits in /metrics",
                             lambda m: total(m, "asyncbatch:prefix_cache_hits_total") >= hits0 + 2 * 8 * 16)
        assert total(after, "asyncbatch:prefix_cache_queries_total") >= queries0 + 3 * len(DRAIN_PREFIX)
        assert max(per_replica(after, "asyncbatch:prefix_cache_hit_rate").values()) > 0
        assert after[("asyncbatch:router_decisions_total", (("model_name", MODEL), ("reason", "cache_hit")))] \
            >= by_cache0 + 2

        # In flight at the signal: one stream that ends within --shutdown-timeout (300 tokens at 20 ms a step:
        # 6 s, long enough to be seen running beside the others while a loaded machine starts streams and
        # answers scrapes in seconds), two that cannot (2,000 tokens: 40 s) and are aborted at it.
        short, short_threads = start_streams(url, 1, 300, [5, 6, 7], AUTH)
        long, long_threads = start_streams(url, 2, 2000, [8, 9, 10], AUTH)
        ingress = (("model_name", MODEL),)
        wait_metrics(url, "3 requests in flight, all started", lambda m: m[(
            "asyncbatch:ingress_requests_in_flight", ingress)] == 3 and m[("asyncbatch:ingress_requests_waiting",
                                                                          ingress)] == 0)
        running = wait_metrics(url, "the long requests running on the replicas",
                               lambda m: total(m, "asyncbatch:num_requests_running") >= 2)
        assert total(running, "asyncbatch:kv_cache_usage_perc") > 0
        start = time.monotonic()
        out = stop_and_check(server, watch, signal.SIGTERM, exit_within_s=60, headers=AUTH)
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
