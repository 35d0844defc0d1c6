"""The gap report's speculative figures: vLLM's counters, emitted tokens per step, and the one-step-late
reconciliation as its own idle cause (``reconcile``: the start of a verify step's apply, ``StepRecord.
reconcile_ms``), in the report, ``summarize`` and the trace, and measured by an engine run on ``sim``."""

from __future__ import annotations

import pytest

from asyncbatch.config import SimConfig
from asyncbatch.profiling.gap_report import CAUSES, attribute_gaps, gap_report
from asyncbatch.profiling.timeline import StepRecord, summarize
from asyncbatch.sampling_params import SamplingParams


def _record(step: int, **values: float) -> StepRecord:
    """Times in ms (``*_ms`` fields as they are, the rest converted to perf_counter seconds)."""
    r = StepRecord(step)
    for name, value in values.items():
        setattr(r, name, value if name.endswith("_ms") or not isinstance(value, float) else value * 1e-3)
    return r


def _two_steps() -> list[StepRecord]:
    # Step 0 runs 1-10 ms; the planner waits for it until 10.5, reconciles 10.5-11.3, applies until 12; step 1
    # is planned 12-12.5 and starts at 13 after a launch latency.
    first = _record(0, plan_start=0.5, schedule_end=0.6, fence_start=0.6, fence_end=0.6, plan_end=0.7,
                    launch_end=0.8, device_start=1.0, device_end=10.0, wait_start=9.0, wait_end=10.5,
                    apply_end=12.0, reconcile_ms=0.8, num_sampled=4, spec_drafts=4, spec_draft_tokens=16,
                    spec_accepted_tokens=6)
    second = _record(1, plan_start=12.0, schedule_end=12.2, fence_start=12.2, fence_end=12.2, plan_end=12.4,
                     launch_end=12.5, device_start=13.0, device_end=23.0, num_sampled=4, spec_drafts=2,
                     spec_draft_tokens=8, spec_accepted_tokens=0)
    return [first, second]


def test_reconcile_is_its_own_cause_ranked_above_apply():
    report = attribute_gaps(_two_steps())
    c = report.causes_ms
    assert "reconcile" in CAUSES
    assert c["result"] == pytest.approx(0.5)  # 10-10.5: the planner had nothing else to do
    assert c["reconcile"] == pytest.approx(0.8)  # 10.5-11.3
    assert c["apply"] == pytest.approx(0.7)  # 11.3-12
    assert c["planning"] == pytest.approx(0.5) and c["launch"] == pytest.approx(0.5)
    assert sum(c.values()) == pytest.approx(report.idle_ms) == pytest.approx(3.0)
    assert [p[2] for p in report.gaps[0].pieces] == ["result", "reconcile", "apply", "planning", "launch"]


def test_speculative_counters_and_per_step_figures():
    records = _two_steps()
    report = attribute_gaps(records)
    spec = report.speculative
    assert spec["spec_decode_num_drafts"] == 6 and spec["spec_decode_num_draft_tokens"] == 24
    assert spec["spec_decode_num_accepted_tokens"] == 6
    assert spec["spec_decode_acceptance_rate"] == pytest.approx(0.25)
    assert spec["spec_decode_mean_acceptance_length"] == pytest.approx(2.0)
    assert spec["emitted_tokens_per_step"] == pytest.approx(7.0)  # (4 + 6 + 4 + 0) / 2
    assert spec["reconcile_ms_per_step"] == pytest.approx(0.4)
    assert report.to_dict()["speculative"] == spec
    summary = summarize(records)
    assert {k: summary[k] for k in spec} == spec


def test_the_trace_shows_the_reconciliation_inside_the_apply():
    from asyncbatch.profiling.trace_export import _planner

    first = _two_steps()[0]
    slices = {e["name"]: e for e in _planner(first, 1, 0.0) if e.get("ph") == "X"}
    assert slices["reconcile"]["ts"] == slices["apply"]["ts"]
    assert slices["reconcile"]["dur"] == pytest.approx(800.0)
    assert slices["apply"]["args"]["accepted"] == 6


def test_a_speculative_sim_run_measures_the_reconciliation(make_llm):
    sim = SimConfig(step_fixed_ms=0.2, per_token_us=0.0, per_context_token_ns=0.0, output_len_min=20,
                    output_len_max=60)
    llm = make_llm(device="sim", sim=sim, engine_process=False, max_num_seqs=16,
                   speculative_config={"num_speculative_tokens": 3, "disable_by_batch_size": None})
    prompts = [[300 + i, 400 + i, 500 + i] for i in range(16)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=50, temperature=0.0, seed=i) for i in range(16)],
                        use_tqdm=False)
    llm.wait_settled(5.0)
    report = gap_report(llm)
    stats = llm.stats()
    assert report.speculative["reconcile_ms_per_step"] > 0.0
    assert report.speculative["emitted_tokens_per_step"] > 16  # several tokens a row per verify step
    assert stats["reconcile_ms_per_step"] == pytest.approx(report.speculative["reconcile_ms_per_step"])
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert sum(report.causes_ms.values()) == pytest.approx(report.idle_ms)
    assert sum(len(o.token_ids) for o in outs) == stats["output_tokens"]
