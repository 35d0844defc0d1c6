"""The prefix-caching workloads and ``scripts/bench_prefix_cache.py`` (run end to end on a tiny model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from in_process import run_program
from tiny_models import save_tiny_model

from asyncbatch.bench.workloads import (
    WORKLOADS,
    WorkItem,
    build_workload,
    multiturn_requests,
    prefix_share,
    shared_prefix_requests,
)

ROOT = Path(__file__).resolve().parents[1]


def test_shared_prefix_requests_share_exactly_the_system_prompt():
    items = shared_prefix_requests(5, 40, 7, 9, vocab_size=1000, seed=3)
    assert [len(it.prompt_token_ids) for it in items] == [47] * 5 and {it.max_tokens for it in items} == {9}
    assert len({tuple(it.prompt_token_ids[:40]) for it in items}) == 1
    assert len({tuple(it.prompt_token_ids[40:]) for it in items}) == 5
    assert items[:3] == shared_prefix_requests(3, 40, 7, 9, vocab_size=1000, seed=3)
    assert build_workload("shared_prefix", 5, 1000, seed=3, output_len=9, system_len=40, question_len=7) == items
    with pytest.raises(ValueError, match="system_len"):
        shared_prefix_requests(2, 0, 0, 4, vocab_size=1000)


def test_multiturn_turns_resend_their_history():
    items = multiturn_requests(7, 3, 10, 4, 6, 5, vocab_size=1000)
    assert "multiturn" in WORKLOADS and len(items) == 7
    conversations = 3  # ceil(7 / 3), first turns first
    lengths = [len(it.prompt_token_ids) for it in items]
    assert lengths == [14] * 3 + [24] * 3 + [34]
    for c in range(conversations):
        first, second = items[c].prompt_token_ids, items[conversations + c].prompt_token_ids
        assert second[:len(first)] == first  # the history is resent...
    assert items[6].prompt_token_ids[:24] == items[3].prompt_token_ids  # ...turn after turn
    assert len({tuple(it.prompt_token_ids[:10]) for it in items}) == 1  # one system prompt


def test_prefix_share_counts_whole_blocks_of_earlier_prompts_and_keeps_the_last_token():
    a = WorkItem(list(range(40)), 1)
    assert prefix_share([a], 16) == 0.0
    assert prefix_share([a, WorkItem(list(range(40)), 1)], 16) == 32 / 80  # 2 of the repeat's blocks
    assert prefix_share([a, WorkItem(list(range(32)), 1)], 16) == 16 / 72  # the last token stays computed
    assert prefix_share([a, WorkItem([99] + list(range(40)), 1)], 16) == 0.0  # same tokens, other position


@pytest.mark.model
def test_bench_prefix_cache_script_end_to_end(tmp_path):
    model = save_tiny_model(tmp_path / "tiny", "LlamaForCausalLM")
    out = tmp_path / "results"
    # A small token budget admits one request per step, so later requests find the system prompt cached.
    args = ["--model", str(model), "--num-requests", "6", "--system-len", "48", "--question-len", "8",
            "--output-len", "4", "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--sim-requests", "24", "--sim-max-num-seqs", "16",
            "--sim-repeats", "1", "--warmup-requests", "2", "--no-progress", "--results-dir", str(out)]
    proc = run_program([sys.executable, str(ROOT / "scripts" / "bench_prefix_cache.py"), *args])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    model_part, sim = doc["model"], doc["sim"]
    assert model_part["on"]["reused_share"] > 0.3 and model_part["off"]["reused_share"] == 0.0
    assert model_part["on"]["config"]["enable_prefix_caching"]
    assert not model_part["off"]["config"]["enable_prefix_caching"]
    assert model_part["correctness"]["results"]["asyncbatch-overlap-no-prefix-cache"]["identical"] == 6
    assert sim["on"]["reused_share"] > 0.3 and sim["off"]["reused_share"] == 0.0
    assert sim["on"]["planner_ms_per_step"] > 0 and sim["off"]["steps"] > 0
    report = (out / "report.md").read_text()
    assert "TTFT P99 (ms)" in report and "planner ms per step (all steps)" in report and "Goal" in report
