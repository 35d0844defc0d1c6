"""``scripts/bench_speculative.py`` end to end on a tiny model, and its shipped prompts.

The tiny byte-level model has no chat template, so the prompts go in as plain text (the script's
fallback); its greedy outputs are random but must be identical with and without speculation (float32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from harness.speculative_report import LLAMACPP_REFERENCE
from harness.speculative_workloads import WORKLOADS, cycle, load_workload, spread
from in_process import run_program
from tiny_models import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_workloads_are_conversations():
    for name in WORKLOADS:
        items = load_workload(name)
        assert len(items) >= 8 and len({it["id"] for it in items}) == len(items)
        for it in items:
            assert it["messages"][-1]["role"] == "user" and it["messages"][-1]["content"].strip()
    assert spread(list(range(8)), 4) == [0, 2, 4, 6] and spread([1, 2], 0) == [1, 2]
    assert cycle([1, 2, 3], 5) == [1, 2, 3, 1, 2]
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope")


def test_bench_speculative_script_end_to_end(tmp_path):
    model = save_tiny_model(tmp_path / "tiny", "LlamaForCausalLM", max_position_embeddings=4096)
    out = tmp_path / "results"
    args = ["--model", str(model), "--single-prompts", "1", "--batch-requests", "2", "--max-tokens", "6",
            "--batch-max-tokens", "4", "--repeats", "1", "--threads", "1", "--out", str(out)]
    proc = run_program([sys.executable, str(ROOT / "scripts" / "bench_speculative.py"), *args])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    assert doc["args"]["dtype"] == "float32" and doc["args"]["quantization"] is None
    for case, requests in (("single", 1), ("batch", 2)):
        for workload in WORKLOADS:
            r = doc["results"][case][workload]
            assert r["num_requests"] == requests
            assert r["tokens"] == {"identical": requests, "compared": requests, "first_mismatch": None}
            assert r["plain"]["output_tokens"] == r["ngram"]["output_tokens"] > 0
            assert r["plain"]["spec_decode_num_drafts"] == 0 and r["ngram"]["output_tok_s"] > 0
            assert len(r["ngram"]["runs"]) == 1
    assert doc["results"]["single"]["grounded"]["plain"]["decode_tok_s"] is not None
    assert [g["target"] for g in doc["goals"]] == [2.0, 1.0, 0.5, 1.0, 1.0]
    report = (out / "report.md").read_text()
    assert "| greedy tokens identical |" in report and "| goal |" in report and "float32" in report
    setup = report.split("\n\n")[3]
    assert "quantization" not in setup and "compile_decode" not in setup  # named only when asked for
    if doc["llamacpp"].get("available") is False:  # not installed (or the tiny model has no GGUF)
        assert str(LLAMACPP_REFERENCE["decode_tok_s"]) in report


def test_bench_one_request_config_names():
    """``bench_one_request.py``'s ``+ngram[K]`` flag: the speculative config it builds and its plain twin."""
    from bench_one_request import plain_twin, speculative_config

    assert speculative_config(["w8a8", "compiled", "ngram6"]) == {"method": "ngram", "num_speculative_tokens": 6}
    assert speculative_config(["ngram"]) == {"method": "ngram"}
    assert speculative_config(["w8a8", "compiled"]) is None
    assert speculative_config(["ngramx"]) is None  # not a draft count: not a speculative flag either
    assert plain_twin("float32+w8a8+compiled+ngram6") == "float32+w8a8+compiled"
    assert plain_twin("bfloat16+int4+ngram") == "bfloat16+int4"


def test_a_batch_goal_without_drafts_says_both_engines_ran_the_same_steps():
    """At 32 requests ``disable_by_batch_size`` turns drafting off: the goal's basis says the ratio compares equal
    work (the machine's spread), and a batch that did verify drafts keeps the plain basis."""
    from harness.speculative_report import goals

    def batch(drafts: int) -> dict:
        ngram_runs = [{"spec_decode_num_drafts": 0}, {"spec_decode_num_drafts": drafts}]
        return {"num_requests": 32, "plain": {"output_tok_s": 100.0, "runs": [{"spec_decode_num_drafts": 0}]},
                "ngram": {"output_tok_s": 93.0, "runs": ngram_runs}}

    (idle,) = goals({"results": {"batch": {"open": batch(0)}}})
    (busy,) = goals({"results": {"batch": {"open": batch(5)}}})
    assert idle["met"] is False and busy["met"] is False and idle["value"] == pytest.approx(0.93)
    assert "no drafts verified" in idle["basis"] and busy["basis"] == "this run"
