"""Smoke tests of the benchmark scripts on a tiny model, and unit tests of their helpers.

The scripts run end to end (all four systems, CPU) as a person runs them, in the
test worker (tests/in_process.py says why); the test then validates the JSON they wrote against the
results schema and checks that every plot the JSON lists is a PNG on disk.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from harness.records import RequestRecord, RunResult
from harness.results_schema import RESULTS_SCHEMA, validation_errors
from harness.run_metrics import run_metrics
from harness.systems import SYSTEM_NAMES, parse_systems
from in_process import Completed, run_program
from tiny_models import save_tiny_model

from asyncbatch.bench.arrivals import arrival_offsets, parse_rates
from asyncbatch.bench.metrics import spread
from asyncbatch.bench.workloads import (
    SHAREGPT,
    build_workload,
    describe,
    nanovllm_requests,
    random_requests,
    sharegpt_requests,
)

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMON = ["--workload", "random", "--input-len", "16", "--output-len", "8", "--range-ratio", "0.5",
          "--num-requests", "6", "--warmup-requests", "2", "--device", "cpu", "--dtype", "float32", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bench") / "tiny", "LlamaForCausalLM")


def _run_script(script: str, args: list[str]) -> Completed:
    proc = run_program([sys.executable, str(ROOT / "scripts" / script), *args])
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _check_document(results: Path, tag: str, kind: str, runs_per_point: int, rates: list) -> dict:
    doc = json.loads((results / f"{tag}.json").read_text())
    assert validation_errors(doc) == []
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(doc, RESULTS_SCHEMA)
    assert doc["kind"] == kind
    assert [s["name"] for s in doc["systems"]] == list(SYSTEM_NAMES)
    assert doc["request_rates"] == rates
    for system in doc["systems"]:
        assert [p["request_rate"] for p in system["points"]] == rates
        for point in system["points"]:
            assert len(point["runs"]) == runs_per_point
            for run in point["runs"]:
                assert run["num_requests"] == 6 and run["output_tokens"] == doc["workload"]["output_tokens"]
                assert run["output_throughput"] > 0 and run["ttft_ms"]["p50"] > 0
    engines = {s["name"]: s["points"][0]["runs"][0]["engine"] for s in doc["systems"]}
    assert 0 < engines["asyncbatch-overlap"]["device_busy_fraction"] <= 1
    assert engines["transformers-generate_batch"] is None
    corr = doc["correctness"]["results"]
    assert corr["asyncbatch-sync"]["identical"] == corr["asyncbatch-sync"]["compared"] == 6
    assert {c["denominator"] for c in doc["comparisons"]} == set(SYSTEM_NAMES[1:])
    assert len(doc["plots"]) == 2
    for name in doc["plots"]:
        data = (results / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000
    assert (results / f"{tag}_table.md").read_text().count("\n") == 2 + len(SYSTEM_NAMES) * len(rates)
    return doc


def test_throughput_script_end_to_end(tiny_model, tmp_path):
    proc = _run_script("bench_throughput.py", ["--model", str(tiny_model), *COMMON, "--repeats", "2",
                                               "--results-dir", str(tmp_path)])
    assert "asyncbatch-overlap / transformers-generate_batch" in proc.stdout
    doc = _check_document(tmp_path, "throughput", "throughput", runs_per_point=2, rates=[None])
    summary = doc["systems"][0]["points"][0]["summary"]["output_throughput"]
    assert summary["n"] == 2 and summary["min"] <= summary["median"] <= summary["max"]
    static = doc["systems"][3]["points"][0]["runs"][0]
    assert static["computed_tokens"] >= static["prompt_tokens"] + static["output_tokens"]  # padding is work


def test_latency_script_end_to_end(tiny_model, tmp_path):
    _run_script("bench_latency.py", ["--model", str(tiny_model), *COMMON, "--repeats", "1",
                                     "--request-rates", "100,inf", "--burstiness", "0.5",
                                     "--results-dir", str(tmp_path), "--tag", "lat"])
    doc = _check_document(tmp_path, "lat", "latency", runs_per_point=1, rates=[100.0, "inf"])
    for system in doc["systems"]:
        for point in system["points"]:
            assert point["runs"][0]["itl_ms"] is not None  # streaming consumers time every delivery
            assert point["cdf"]["ttft_ms"] and len(point["cdf"]["ttft_ms"]) == 101


# -- helpers ---------------------------------------------------------------------------------------------------
def test_random_workload_follows_vllm_range_ratio():
    items = random_requests(500, input_len=100, output_len=40, range_ratio=0.25, vocab_size=1000, seed=3)
    prompts = [len(it.prompt_token_ids) for it in items]
    outputs = [it.max_tokens for it in items]
    assert min(prompts) >= 75 and max(prompts) <= 125 and len(set(prompts)) > 30
    assert min(outputs) >= 30 and max(outputs) <= 50
    assert all(256 <= t < 1000 for it in items for t in it.prompt_token_ids)
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(1, 10, 10, 1.0, 1000)


def test_nanovllm_workload_matches_published_totals():
    full = describe(nanovllm_requests(256))
    assert (full["prompt_tokens"], full["output_tokens"]) == (142_827, 133_966)  # nano-vllm's README
    assert nanovllm_requests(8, vocab_size=300)[0].max_tokens == nanovllm_requests(256)[0].max_tokens
    assert max(t for it in nanovllm_requests(4, vocab_size=300) for t in it.prompt_token_ids) < 300


def test_sharegpt_workload_means_and_clipping():
    items = sharegpt_requests(4000, vocab_size=50_000, seed=1)
    d = describe(items)
    assert abs(d["prompt_len_mean"] - SHAREGPT.input_mean) / SHAREGPT.input_mean < 0.1
    assert abs(d["output_len_mean"] - SHAREGPT.output_mean) / SHAREGPT.output_mean < 0.1
    assert d["prompt_len_min"] >= 4 and d["prompt_len_max"] <= 1024
    assert all(len(it.prompt_token_ids) + it.max_tokens <= 2048 for it in items)


@pytest.mark.parametrize("name", ["uniform", "random", "sharegpt", "nanovllm"])
def test_smaller_workload_is_a_prefix(name):
    big = build_workload(name, 40, 5000, seed=7, input_len=64, output_len=32, range_ratio=0.5)
    small = build_workload(name, 10, 5000, seed=7, input_len=64, output_len=32, range_ratio=0.5)
    assert small == big[:10]


def test_arrivals_poisson_and_bursty():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    for burstiness in (1.0, 0.25):
        t = arrival_offsets(4000, rate=20.0, burstiness=burstiness, seed=0)
        assert t == sorted(t) and t[0] == 0.0
        assert abs(len(t) / t[-1] - 20.0) / 20.0 < 0.15  # mean rate holds for any burstiness
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0")


def test_run_metrics_definitions():
    records = [RequestRecord(10, 5, arrival=0.0, first_token=0.1, finish=0.5, chunk_times=[0.1, 0.2, 0.3, 0.4, 0.5]),
               RequestRecord(20, 1, arrival=0.0, first_token=0.3, finish=0.3, chunk_times=[0.3])]
    m = run_metrics(RunResult("x", records, start=0.0, end=1.0))
    assert m["output_throughput"] == pytest.approx(6.0) and m["total_token_throughput"] == pytest.approx(36.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5 - 0.1) / (5 - 1); the 1-token request has none
    assert m["ttft_ms"]["p50"] == pytest.approx(200.0) and m["itl_ms"]["p99"] == pytest.approx(100.0)
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "rel_spread": 1.0, "n": 3}


def test_schema_validator_reports_problems():
    errors = validation_errors({"schema": "asyncbatch-bench/1", "kind": "other", "systems": {}})
    assert any("kind" in e for e in errors) and any("missing 'plots'" in e for e in errors)
    assert any("systems: expected array" in e for e in errors)


def test_system_names():
    assert parse_systems("all") == list(SYSTEM_NAMES)
    assert parse_systems("overlap,cb,overlap") == ["asyncbatch-overlap", "transformers-generate_batch"]
    with pytest.raises(ValueError, match="unknown system"):
        parse_systems("vllm")
