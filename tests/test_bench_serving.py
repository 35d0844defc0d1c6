"""The serving benchmark: its metrics against hand-computed values, its HTTP client against a fake
OpenAI-compatible server (``fake_openai_server``), its server processes, and the script end to end.

Every server binds 127.0.0.1 on a free port; every wait is bounded (HTTP timeouts, start-up
timeouts, subprocess timeouts).
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest
from fake_openai_server import MODEL, FakeServer
from harness.serving_peers import parse_systems, render
from harness.serving_servers import (
    ManagedServer,
    ServerSpec,
    ServerStartError,
    asyncbatch_spec,
    transformers_spec,
    workload_kv_tokens,
)
from in_process import Completed, run_program
from tiny_models import save_tiny_model

from asyncbatch.bench.host_load import ServerLoad, process_group_cpu_s
from asyncbatch.bench.schema import SERVING_SCHEMA, validation_errors
from asyncbatch.bench.serving_client import (
    OPENAI,
    TRANSFORMERS,
    VLLM,
    ClientOptions,
    LoadRun,
    RequestResult,
    ServingRequest,
    replay,
    request_body,
)
from asyncbatch.bench.serving_metrics import SLO, summarize
from asyncbatch.bench.serving_prometheus import parse_prometheus, window
from asyncbatch.bench.serving_report import comparisons
from asyncbatch.bench.serving_runner import LoadPoint, RunPlan, load_points, point_requests, run_point
from asyncbatch.bench.serving_script import UsageError, choose_prompt_format, parse_concurrency

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ok(index: int, sent: float, first: float, finish: float, tokens: int, chunks: list[float] | None = None,
        max_tokens: int | None = None) -> RequestResult:
    return RequestResult(index=index, max_tokens=tokens if max_tokens is None else max_tokens, sent=sent,
                         end=finish, success=True, first_token=first, finish=finish,
                         chunk_times=chunks if chunks is not None else [first, finish][:max(1, min(tokens, 2))],
                         finish_reason="length", saw_done=True, prompt_tokens=10, completion_tokens=tokens)


def _failed(index: int, sent: float, error: str) -> RequestResult:
    return RequestResult(index=index, max_tokens=8, sent=sent, end=sent + 0.01, error=error)


def _run(results: list[RequestResult], start: float = 0.0, end: float = 2.0) -> LoadRun:
    return LoadRun(results, start, end, client_cpu_s=0.1)


def _replay(server: FakeServer, requests: list[ServingRequest], offsets: list[float] | None = None,
            dialect=VLLM, options: ClientOptions | None = None, cap: int | None = None) -> LoadRun:
    options = options or ClientOptions(timeout_s=20)
    offsets = offsets if offsets is not None else [0.0] * len(requests)
    return asyncio.run(replay(server.base_url, MODEL, requests, offsets, dialect, options, cap))


# --- per-request quantities and the summary, against hand-computed values ---------------------------------


def test_tpot_ttft_e2e_and_itl_of_one_request():
    r = _ok(0, sent=1.0, first=1.2, finish=1.6, tokens=5, chunks=[1.2, 1.3, 1.35, 1.5, 1.6])
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.6)
    assert r.tpot == pytest.approx(0.4 / 4)
    assert r.itls() == pytest.approx([0.1, 0.05, 0.15, 0.1])


def test_a_one_token_output_has_no_tpot():
    r = _ok(0, sent=0.0, first=0.3, finish=0.3, tokens=1)
    assert r.tpot is None
    assert r.ttft == pytest.approx(0.3)
    assert r.itls() == []


def test_output_tokens_come_from_usage_else_from_chunks():
    r = _ok(0, sent=0.0, first=0.1, finish=0.2, tokens=6, chunks=[0.1, 0.2])
    assert (r.output_tokens, r.tokens_from_usage) == (6, True)
    r.completion_tokens = None
    assert (r.output_tokens, r.tokens_from_usage) == (2, False)


def test_summary_percentiles_throughput_and_failures_by_hand():
    results = [
        _ok(0, sent=0.0, first=0.1, finish=0.5, tokens=5),  # TTFT 100 ms, TPOT 100 ms, E2E 500 ms
        _ok(1, sent=0.5, first=0.7, finish=1.5, tokens=9),  # TTFT 200 ms, TPOT 100 ms, E2E 1000 ms
        _ok(2, sent=1.0, first=1.3, finish=1.3, tokens=1),  # TTFT 300 ms, no TPOT, E2E 300 ms
        _failed(3, sent=1.0, error="HTTP 503: busy"),
        _failed(4, sent=1.1, error="HTTP 503: busy"),
        _failed(5, sent=1.2, error="ReadError after 2 chunks: x"),
    ]
    s = summarize(_run(results, 0.0, 2.0), SLO())
    assert (s["num_requests"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["failure_reasons"] == [{"error": "HTTP 503: busy", "count": 2},
                                    {"error": "ReadError after 2 chunks: x", "count": 1}]
    assert s["output_tokens"] == 15 and s["prompt_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(3 / 2.0)
    assert s["output_throughput"] == pytest.approx(15 / 2.0)
    assert s["total_token_throughput"] == pytest.approx(45 / 2.0)
    # numpy's linear interpolation: P50 of (100, 200, 300) is 200, P90 is 100 + 0.9 * 200 = 280, P99 298.
    assert s["ttft_ms"] == pytest.approx({"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0})
    assert s["tpot_ms"] == pytest.approx({"mean": 100.0, "p50": 100.0, "p90": 100.0, "p99": 100.0})
    assert s["e2e_ms"]["p50"] == pytest.approx(500.0)
    # Without an SLO every successful request is good; failures never are.
    assert s["goodput"] == pytest.approx(3 / 2.0)
    assert s["slo_attainment"] == pytest.approx(3 / 6)


def test_goodput_under_ttft_and_tpot_slos():
    results = [
        _ok(0, sent=0.0, first=0.1, finish=0.5, tokens=5),  # TTFT 100, TPOT 100
        _ok(1, sent=0.0, first=0.2, finish=0.4, tokens=5),  # TTFT 200, TPOT 50
        _ok(2, sent=0.0, first=0.3, finish=0.3, tokens=1),  # TTFT 300, one token: no TPOT
        _failed(3, sent=0.0, error="boom"),
    ]
    run = _run(results, 0.0, 4.0)
    assert summarize(run, SLO(ttft_ms=250))["goodput"] == pytest.approx(2 / 4.0)
    assert summarize(run, SLO(tpot_ms=60))["goodput"] == pytest.approx(2 / 4.0)  # request 0 misses, 2 has no TPOT
    assert summarize(run, SLO(ttft_ms=250, tpot_ms=60))["goodput"] == pytest.approx(1 / 4.0)
    assert summarize(run, SLO(ttft_ms=350, tpot_ms=100))["slo_attainment"] == pytest.approx(3 / 4)


def test_an_slo_must_be_positive():
    with pytest.raises(ValueError, match="ttft_ms"):
        SLO(ttft_ms=0)


def test_outputs_other_than_max_tokens_are_counted():
    results = [_ok(0, 0.0, 0.1, 0.2, tokens=4, max_tokens=8), _ok(1, 0.0, 0.1, 0.2, tokens=8, max_tokens=8)]
    s = summarize(_run(results), SLO())
    assert s["outputs_not_max_tokens"] == 1
    assert s["output_tokens"] == 12 and s["requested_output_tokens"] == 16


def test_an_all_failed_point_has_no_latencies_and_zero_throughput():
    s = summarize(_run([_failed(0, 0.0, "x")]), SLO(ttft_ms=10))
    assert (s["completed"], s["output_throughput"], s["goodput"]) == (0, 0.0, 0.0)
    assert s["ttft_ms"] is None and s["itl_ms"] is None


def test_comparisons_divide_the_first_system_by_the_others():
    def system(name: str, tput: float, ttft99: float, tpot99: float) -> dict:
        summary = {"output_throughput": tput, "goodput": 1.0, "ttft_ms": {"p99": ttft99}, "tpot_ms": {"p99": tpot99}}
        return {"name": name, "points": [{"load": {"label": "1 req/s"}, "summary": summary}]}
    [c] = comparisons([system("asyncbatch", 150.0, 50.0, 20.0), system("transformers", 100.0, 100.0, 40.0)])
    assert c["output_throughput_ratio"] == pytest.approx(1.5)
    assert (c["p99_ttft_ratio"], c["p99_tpot_ratio"]) == (pytest.approx(0.5), pytest.approx(0.5))


# --- request bodies and dialects --------------------------------------------------------------------------


def test_request_bodies_per_dialect():
    req = ServingRequest("hello", 7)
    vllm = request_body("m", req, VLLM, ClientOptions())
    assert vllm["ignore_eos"] is True and vllm["stream"] is True and vllm["max_tokens"] == 7
    assert vllm["stream_options"] == {"include_usage": True}
    tf = request_body("m", req, TRANSFORMERS, ClientOptions())
    assert "ignore_eos" not in tf
    assert json.loads(tf["generation_config"]) == {"eos_token_id": -1, "do_sample": False}
    assert "ignore_eos" not in request_body("m", req, OPENAI, ClientOptions())
    assert "generation_config" not in request_body("m", req, TRANSFORMERS, ClientOptions(ignore_eos=False))
    with pytest.raises(ValueError, match="text prompts"):
        request_body("m", ServingRequest([1, 2], 3), TRANSFORMERS, ClientOptions())
    chat = request_body("m", req, VLLM, ClientOptions(endpoint="chat"))
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "prompt" not in chat


# --- the client against the fake server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def fake():
    with FakeServer(token_delay_s=0.002) as server:
        yield server


def test_streaming_text_and_token_id_prompts(fake):
    run = _replay(fake, [ServingRequest("two words", 5), ServingRequest([5, 6, 7], 4)])
    text, ids = run.results
    assert text.success and ids.success, (text.error, ids.error)
    assert (text.output_tokens, text.prompt_tokens, len(text.chunk_times)) == (5, 2, 5)
    assert (ids.output_tokens, ids.prompt_tokens) == (4, 3)
    assert text.prompt_len is None  # the tests' requests carry no count of their own
    assert text.saw_done and text.finish_reason == "length" and text.tokens_from_usage
    assert text.sent < text.first_token <= text.finish <= text.end
    assert text.chunk_times == sorted(text.chunk_times)
    assert run.start <= min(r.sent for r in run.results) and run.end >= max(r.end for r in run.results)


def test_chat_role_chunk_is_not_a_token(fake):
    [r] = _replay(fake, [ServingRequest("hi", 3)], options=ClientOptions(endpoint="chat", timeout_s=20)).results
    assert r.success, r.error
    assert len(r.chunk_times) == 3 and r.output_tokens == 3
    assert r.first_token == r.chunk_times[0]


def test_several_tokens_per_chunk_count_by_usage(fake):
    [r] = _replay(fake, [ServingRequest("multi", 5)]).results
    assert r.success, r.error
    assert len(r.chunk_times) == 3 and r.output_tokens == 5
    assert r.tpot == pytest.approx((r.finish - r.first_token) / 4)


def test_failures_are_counted_with_their_reasons(fake):
    requests = [ServingRequest("fine", 4), ServingRequest("too long", 5000), ServingRequest("disconnect", 6),
                ServingRequest("error-event", 5), ServingRequest("no-finish", 5)]
    run = _replay(fake, requests)
    ok, http400, dropped, error_event, unfinished = run.results
    assert ok.success
    assert not http400.success and http400.error.startswith("HTTP 400") and "too large" in http400.error
    assert not dropped.success and "after 2 chunks" in dropped.error and len(dropped.chunk_times) == 2
    assert not error_event.success and error_event.error == "error event: boom"
    assert not unfinished.success and "without [DONE] or finish_reason" in unfinished.error
    s = summarize(run, SLO())
    assert (s["completed"], s["failed"]) == (1, 4)
    assert sum(f["count"] for f in s["failure_reasons"]) == 4
    assert s["output_tokens"] == 4  # the failed requests' tokens are not throughput


def test_unknown_model_is_an_http_404_failure(fake):
    run = asyncio.run(replay(fake.base_url, "no-such-model", [ServingRequest("x", 2)], [0.0], VLLM,
                             ClientOptions(timeout_s=20)))
    assert not run.results[0].success and run.results[0].error.startswith("HTTP 404")


def test_a_stream_without_done_but_with_finish_reason_succeeds(fake):
    [r] = _replay(fake, [ServingRequest("no-done", 3)]).results
    assert r.success and not r.saw_done and r.output_tokens == 3


def test_tokens_without_text_are_delivered_with_the_last_chunk(fake):
    run = _replay(fake, [ServingRequest("blank", 4)])
    [r] = run.results
    assert r.success and r.output_tokens == 4 and r.text_chars == 0
    assert r.chunk_times == [r.first_token] == [r.finish] and r.first_token == r.last_choice
    assert summarize(run, SLO())["completed_without_text"] == 1


def test_a_stream_without_usage_is_counted_by_chunks(fake):
    [r] = _replay(fake, [ServingRequest("no-usage", 4)]).results
    assert r.success and not r.tokens_from_usage and r.output_tokens == 4 and r.prompt_tokens is None


def test_a_connection_refused_is_a_failure_not_an_exception():
    from harness.common import free_port
    run = asyncio.run(replay(f"http://127.0.0.1:{free_port()}", MODEL, [ServingRequest("x", 2)], [0.0], VLLM,
                             ClientOptions(timeout_s=5)))
    assert not run.results[0].success and "ConnectError" in run.results[0].error


def test_arrival_offsets_are_respected(fake):
    run = _replay(fake, [ServingRequest("a", 2), ServingRequest("b", 2)], offsets=[0.0, 0.3])
    first, second = run.results
    assert second.sent - run.start >= 0.3 - 1e-3
    assert first.sent - run.start < 0.2


def test_max_concurrency_caps_requests_in_flight(fake):
    run = _replay(fake, [ServingRequest(f"p{i}", 5) for i in range(4)], cap=1)
    spans = sorted((r.sent, r.end) for r in run.results)
    assert all(r.success for r in run.results)
    assert all(later_sent >= earlier_end - 1e-3 for (_, earlier_end), (later_sent, _) in pairwise(spans))


# --- /metrics ---------------------------------------------------------------------------------------------


def test_prometheus_text_is_parsed_and_summed_over_labels():
    text = ('# HELP asyncbatch:num_requests_running running\n# TYPE asyncbatch:num_requests_running gauge\n'
            'asyncbatch:num_requests_running{model_name="a"} 3\n'
            'asyncbatch:num_requests_running{model_name="b"} 4.5\n'
            'asyncbatch:device_busy_seconds_total 12.5\n'
            'weird_line_without_value\n'
            'asyncbatch:e2e_request_latency_seconds_bucket{le="+Inf",model_name="a"} 7\n')
    values = parse_prometheus(text)
    assert values["asyncbatch:num_requests_running"] == 7.5
    assert values["asyncbatch:device_busy_seconds_total"] == 12.5
    assert values["asyncbatch:e2e_request_latency_seconds_bucket"] == 7
    assert "weird_line_without_value" not in values


def test_device_busy_is_the_ratio_of_counter_deltas():
    before = {"asyncbatch:device_busy_seconds_total": 10.0, "asyncbatch:device_span_seconds_total": 20.0,
              "asyncbatch:generation_tokens_total": 100.0}
    after = {"asyncbatch:device_busy_seconds_total": 19.0, "asyncbatch:device_span_seconds_total": 30.0,
             "asyncbatch:generation_tokens_total": 400.0}
    w = window(before, after, None, None)
    assert w["available"] and w["device_busy_fraction"] == pytest.approx(0.9)
    assert w["generation_tokens"] == 300.0 and w["prompt_tokens"] is None
    missing = window({"x": 1.0}, {"x": 2.0}, None, None)
    assert not missing["available"] and "device_busy_seconds_total" in missing["note"]
    assert window(None, None, None, "GET /metrics answered HTTP 404") == {
        "available": False, "note": "GET /metrics answered HTTP 404"}


def test_a_load_point_samples_the_servers_gauges(fake):
    requests = [ServingRequest(f"p{i}", 30) for i in range(6)]
    plan = RunPlan([LoadPoint(math.inf)], [requests], [], ClientOptions(timeout_s=20), SLO(), sample_interval_s=0.02)
    result = run_point(fake.base_url, MODEL, VLLM, plan, 0)
    server = result["server"]
    assert server["available"] and server["device_busy_fraction"] == pytest.approx(0.8)
    assert server["gauges"]["samples"] >= 1 and server["gauges"]["running"]["max"] >= 1
    assert result["summary"]["completed"] == 6 and len(result["requests"]) == 6


def test_load_points_and_slices():
    points = load_points([1.0, math.inf], [None, 4])
    assert [p.label for p in points] == ["1 req/s", "1 req/s, <= 4 in flight", "inf req/s",
                                         "inf req/s, <= 4 in flight"]
    reqs = [ServingRequest(str(i), 1) for i in range(7)]
    slices, rest = point_requests(reqs, 3, 2)
    assert [[r.prompt for r in s] for s in slices] == [["0", "1", "2"], ["3", "4", "5"]]
    assert [r.prompt for r in rest] == ["6"]
    with pytest.raises(ValueError, match="need 9"):
        point_requests(reqs, 3, 3)


# --- server processes -------------------------------------------------------------------------------------


def test_the_cpu_time_of_a_process_group_is_counted():
    proc = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass"],
                            start_new_session=True)
    try:
        with ServerLoad(proc.pid) as load:
            time.sleep(0.5)
        result = load.result()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert 0.2 < result["server_cpu_s"] < 1.0
    assert result["contention"] is not None and process_group_cpu_s(proc.pid) is None  # gone after the kill


def _python_server_spec(code: str) -> ServerSpec:
    from harness.common import free_port
    return ServerSpec("test", [sys.executable, "-c", code], free_port(), VLLM, "test")


def test_managed_server_starts_answers_and_stops(tmp_path):
    from harness.common import free_port
    port = free_port()
    spec = ServerSpec("fake", [sys.executable, str(ROOT / "tests" / "fake_openai_server.py"), "--port", str(port)],
                      port, VLLM, "fake server process")
    server = ManagedServer(spec, tmp_path / "logs" / "fake.log", startup_timeout_s=60, stop_timeout_s=10)
    with server:
        assert server.ready_s is not None and server.served_model() == MODEL
        pid = server.process.pid
    assert server.process is None and server.returncode is not None
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(pid, 0)
    assert (tmp_path / "logs" / "fake.log").exists()


def test_a_server_that_exits_early_fails_with_its_log(tmp_path):
    spec = _python_server_spec("import sys; print('cannot load the model', flush=True); sys.exit(3)")
    server = ManagedServer(spec, tmp_path / "early.log", startup_timeout_s=30)
    with pytest.raises(ServerStartError, match="code 3") as info, server:
        pass
    assert "cannot load the model" in str(info.value)
    assert server.process is None


def test_a_server_that_never_gets_ready_is_killed_at_the_timeout(tmp_path):
    spec = _python_server_spec("import time; time.sleep(120)")
    server = ManagedServer(spec, tmp_path / "slow.log", startup_timeout_s=1.0, stop_timeout_s=5)
    with pytest.raises(ServerStartError, match="within 1 s"), server:
        pass
    assert server.process is None and server.returncode is not None


def test_server_command_lines():
    ab = asyncbatch_spec("/m", "sim", "float32", 256, 2048, 0, ["--sim-step-ms", "1"], port=1234)
    assert ab.argv[1:5] == ["-m", "asyncbatch", "serve", "/m"] and ab.base_url == "http://127.0.0.1:1234"
    assert ab.argv[-2:] == ["--sim-step-ms", "1"] and "--max-num-seqs" in ab.argv and ab.dialect is VLLM
    assert "--num-threads" not in ab.argv and "OMP_NUM_THREADS" not in ab.env
    one = asyncbatch_spec("/m", "cpu", "float32", 256, 2048, 0, port=1234, torch_threads=1)
    assert one.argv[one.argv.index("--num-threads") + 1] == "1" and one.env["OMP_NUM_THREADS"] == "1"
    assert transformers_spec("/m", "cpu", "float32", 2048, None, torch_threads=1).env == {"OMP_NUM_THREADS": "1"}
    tf = transformers_spec("/m", "cpu", "float32", 2048, kv_tokens=1000, port=4321)
    assert tf.argv[1:3] == ["serve", "--continuous-batching"] and tf.argv[-1] == "/m"
    assert tf.argv[tf.argv.index("--cb-num-blocks") + 1] == "4"  # ceil(1000 / 256)
    assert tf.argv[tf.argv.index("--cb-max-batch-tokens") + 1] == "2048" and tf.dialect is TRANSFORMERS
    with pytest.raises(ValueError, match="real device"):
        transformers_spec("/m", "sim", "float32", 2048, None)
    assert "--cb-num-blocks" not in transformers_spec("/m", "cpu", "float32", 2048, kv_tokens=None).argv


def test_the_peers_cache_is_sized_for_the_largest_point():
    first = [ServingRequest("a", 155, prompt_len=100), ServingRequest("b", 100, prompt_len=200)]  # 1 + 2 pages
    second = [ServingRequest([1] * 10, 10)]  # length of the token ids: 1 page
    assert workload_kv_tokens([first, second], page_size=256) == 3 * 256


# --- the script end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    # The vocabulary is the byte tokenizer's (3 specials + 256 bytes), so that the workload's token ids
    # (drawn from 256 up) decode to non-empty text prompts.
    return save_tiny_model(tmp_path_factory.mktemp("serving") / "tiny", "LlamaForCausalLM", vocab_size=259)


def _run_script(args: list[str]) -> Completed:
    """In the test worker (tests/in_process.py says why); the servers it starts are processes of their own."""
    proc = run_program([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), *args])
    assert proc.returncode == 0, f"bench_serving.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _check_document(out: Path, tag: str) -> dict:
    doc = json.loads((out / f"{tag}.json").read_text())
    assert validation_errors(doc, SERVING_SCHEMA) == []
    import jsonschema
    jsonschema.validate(doc, SERVING_SCHEMA)
    for name in doc["plots"]:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    markdown = (out / f"{tag}.md").read_text()
    assert markdown.startswith("Machine: ") and "| load | system |" in markdown
    return doc


def test_script_against_a_running_server_writes_a_complete_report(fake, tiny_model, tmp_path):
    out = tmp_path / "out"
    proc = _run_script(["--base-url", fake.base_url, "--base-url-name", "fake", "--model", str(tiny_model),
                        "--workload", "uniform", "--prompt-range", "4,12", "--output-range", "2,6",
                        "--num-prompts", "6", "--request-rates", "20,inf", "--max-concurrency", "3",
                        "--warmup-requests", "2", "--slo-ttft-ms", "5000", "--prompt-format", "text",
                        "--out", str(out), "--tag", "t"])
    doc = _check_document(out, "t")
    assert [load["label"] for load in doc["loads"]] == ["20 req/s, <= 3 in flight", "inf req/s, <= 3 in flight"]
    [system] = doc["systems"]
    assert system["name"] == "fake" and system["served_model"] == MODEL and system["command"] is None
    assert system["warmup"]["completed"] == 2
    for point in system["points"]:
        s = point["summary"]
        assert (s["num_requests"], s["completed"], s["failed"]) == (6, 6, 0)
        assert s["outputs_not_max_tokens"] == 0 and s["goodput"] > 0
        assert point["server"]["available"] and len(point["requests"]) == 6
        # A server this run did not start: its CPU cannot be told from other processes'.
        assert point["host"]["server_cpu_s"] is None and point["host"]["contention"] is None
        assert point["host"]["client_cpu_s"] > 0
    assert doc["settings"]["prompt_format"] == "text" and doc["workload"]["text_prompt_tokens"] > 0
    assert doc["plots"] == ["t_latency_vs_load.png"]
    assert "fake" in proc.stdout and "TTFT p99" in proc.stdout
    # The Markdown and the PNG are drawn from the JSON alone, so they can be redrawn from it.
    redrawn = render(out / "t.json", tmp_path / "redrawn", "r")
    assert (tmp_path / "redrawn" / "r.md").read_text() == (out / "t.md").read_text()
    assert (tmp_path / "redrawn" / "r_latency_vs_load.png").read_bytes()[:8] == PNG_MAGIC
    assert redrawn["plots"] == ["r_latency_vs_load.png"]


def test_an_interrupted_run_reports_the_points_it_finished(fake, tiny_model, tmp_path):
    """SIGTERM during the second load point: the first point is in the report, the system says why it
    stopped, and the exit status is 128 + SIGTERM."""
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--base-url", fake.base_url,
                             "--model", str(tiny_model), "--num-prompts", "4", "--request-rates", "inf,0.05",
                             "--output-range", "2,4", "--warmup-requests", "0", "--out", str(out), "--tag", "i"],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stderr:  # the script logs each finished point
            if "inf req/s" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    doc = _check_document(out, "i")
    [system] = doc["systems"]
    assert [p["load"]["label"] for p in system["points"]] == ["inf req/s"]
    assert system["error"].startswith("interrupted") and any("interrupted" in n for n in doc["notes"])


def test_prompt_format_and_command_line_lists():
    assert choose_prompt_format("auto", [VLLM], "completions") == "token-ids"
    assert choose_prompt_format("auto", [VLLM, TRANSFORMERS], "completions") == "text"
    assert choose_prompt_format("auto", [VLLM], "chat") == "text"
    with pytest.raises(UsageError, match="text prompts only"):
        choose_prompt_format("token-ids", [VLLM, TRANSFORMERS], "completions")
    assert parse_systems("asyncbatch, transformers") == ["asyncbatch", "transformers"]
    for bad in ("vllm", "asyncbatch,asyncbatch", ""):
        with pytest.raises(UsageError):
            parse_systems(bad)
    assert parse_concurrency(None) == [None] and parse_concurrency("1,8") == [1, 8]
    with pytest.raises(UsageError):
        parse_concurrency("0")


@pytest.mark.slow
def test_script_against_transformers_serve(tiny_model, tmp_path):
    """The peer end to end on a tiny model: text prompts, EOS off through generation_config, usage counts."""
    out = tmp_path / "tf"
    _run_script(["--systems", "transformers", "--model", str(tiny_model), "--workload", "uniform",
                 "--prompt-range", "4,12", "--output-range", "4,12", "--num-prompts", "4", "--request-rates", "inf",
                 "--warmup-requests", "1", "--startup-timeout", "180", "--request-timeout", "120",
                 "--out", str(out), "--tag", "tf"])
    doc = _check_document(out, "tf")
    [system] = doc["systems"]
    assert system["error"] is None and system["exit_code"] is not None
    [point] = system["points"]
    s = point["summary"]
    assert (s["completed"], s["failed"], s["outputs_not_max_tokens"]) == (4, 0, 0)
    assert s["output_tokens_from_usage"] == 4 and not point["server"]["available"]
    assert point["host"]["server_cpu_s"] > 0 and 0 <= point["host"]["contention"] <= 1
    assert any("generation_config" in n for n in doc["notes"])
    assert (out / "logs" / "tf_transformers.log").exists()


@pytest.mark.slow
def test_script_against_asyncbatch_serve_on_sim(tmp_path):
    """The real server end to end on the simulated device: exact output lengths, device busy from /metrics,
    the server's token counters equal to the client's counts, nothing failed."""
    out = tmp_path / "sim"
    _run_script(["--systems", "asyncbatch", "--device", "sim", "--workload", "uniform", "--prompt-range", "16,64",
                 "--output-range", "8,32", "--num-prompts", "20", "--request-rates", "50,inf", "--warmup-requests",
                 "2", "--metrics-interval", "0.1", "--slo-ttft-ms", "10000", "--startup-timeout", "180",
                 "--request-timeout", "120", "--out", str(out), "--tag", "sim"])
    doc = _check_document(out, "sim")
    [system] = doc["systems"]
    assert system["error"] is None and system["exit_code"] == 0  # SIGTERM drains and exits 0
    assert system["served_model"] and system["command"][1:4] == ["-m", "asyncbatch", "serve"]
    assert doc["settings"]["prompt_format"] == "token-ids" and any("SIMULATED" in n for n in doc["notes"])
    for point in system["points"]:
        s, server = point["summary"], point["server"]
        assert (s["completed"], s["failed"], s["outputs_not_max_tokens"]) == (20, 0, 0)
        assert s["output_tokens"] == s["requested_output_tokens"] and s["streams_with_done"] == 20
        # Token-id prompts: the server counts exactly the workload's prompt tokens.
        assert all(r["prompt_tokens"] == r["prompt_len"] > 0 for r in point["requests"])
        assert server["available"] and 0 < server["device_busy_fraction"] <= 1 + 1e-9
        assert server["generation_tokens"] == s["output_tokens"]
        assert server["prompt_tokens"] == s["prompt_tokens"]
        assert point["host"]["server_cpu_s"] > 0 and s["ttft_ms"]["p99"] >= s["ttft_ms"]["p50"] > 0
