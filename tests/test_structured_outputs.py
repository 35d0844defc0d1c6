"""Structured outputs under overlap: masks filled while the forward runs, tokens as in synchronous mode.

Random logits are the hardest case for a mask (a trained model mostly wants what the grammar allows):
1,000 requests over every case of the catalogue (JSON schemas, json_object, regexes, choices, grammars),
on a tiny random model and on the sim device, with preemption, prefix caching and the integrity check after
every step. Every output that finishes with ``stop`` must satisfy its constraint; overlap and synchronous
mode must produce the same tokens. The peers' bugs this guards against: the grammar state advanced with
the wrong token under async scheduling (vllm #29379), masks for the wrong step.
"""

from __future__ import annotations

import json
import re

import pytest
from harness.structured_cases import CASES
from tiny_models import save_tiny_model

from asyncbatch import LLM, SamplingParams, SimConfig, StructuredOutputsParams

pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (pip install .[structured])")

NUM_REQUESTS = 1000
MAX_TOKENS = 48


def _requests(n: int) -> tuple[list[str], list[SamplingParams], list]:
    prompts, params, checks = [], [], []
    for i in range(n):
        case = CASES[i % len(CASES)]
        # A few shared prompts per case, so prefix caching hits while other requests are preempted.
        prompts.append(f"Answer as {case.name}, variant {i % 3}: ")
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured_outputs=case.params))
        checks.append(case)
    return prompts, params, checks


def _run(llm_kwargs: dict, n: int) -> tuple[list, dict]:
    prompts, params, _ = _requests(n)
    with LLM(**llm_kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    return outputs, stats


def _check_outputs(outputs: list, n: int, min_stop_fraction: float) -> None:
    _, _, cases = _requests(n)
    stopped = 0
    for out, case in zip(outputs, cases):
        assert out.finish_reason in ("stop", "length"), (case.name, out.finish_reason, out.error)
        if out.finish_reason == "stop":
            stopped += 1
            case.check(out.text)
    assert len(CASES) >= 20
    assert stopped >= min_stop_fraction * n, f"only {stopped} of {n} outputs finished by their grammar"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("structured") / "llama", "LlamaForCausalLM")


@pytest.mark.slow
def test_tiny_random_model_overlap_equals_sync_and_every_stop_is_valid(tiny_model):
    # 48 blocks of 16 tokens for 32 running requests of up to ~70 tokens: preemption is certain.
    common = {"model": str(tiny_model), "device": "cpu", "dtype": "float32", "max_num_seqs": 32,
              "num_kv_blocks": 48, "enable_prefix_caching": True, "debug_check_integrity": True}
    overlapped, stats = _run({**common, "overlap": True}, NUM_REQUESTS)
    synchronous, _ = _run({**common, "overlap": False}, NUM_REQUESTS)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in synchronous]
    assert stats["preemptions"] > 0, "the run was meant to preempt"
    assert stats["mask_fill_us_per_row"] > 0
    _check_outputs(overlapped, NUM_REQUESTS, min_stop_fraction=0.5)


@pytest.mark.slow
def test_sim_device_overlap_equals_sync_with_the_default_tokenizer():
    """The sim device samples among the mask's allowed tokens of the default model's 49,152-token vocabulary:
    the mask meets the overlap loop exactly as on a real device, at GPU step times."""
    sim = SimConfig(step_fixed_ms=0.2, per_token_us=0.5, output_len_min=8, output_len_max=64)
    common = {"device": "sim", "max_num_seqs": 64, "num_kv_blocks": 200, "enable_prefix_caching": True,
              "debug_check_integrity": True, "sim": sim}
    n = NUM_REQUESTS // 2
    overlapped, stats = _run({**common, "overlap": True}, n)
    synchronous, _ = _run({**common, "overlap": False}, n)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in synchronous]
    _check_outputs(overlapped, n, min_stop_fraction=0.3)
    assert stats["mask_fill_us_per_row"] > 0
    # The fill's CPU time is the planner thread's own over the same span: never more than its wall time.
    assert 0 < stats["mask_fill_cpu_ms_per_step"] <= stats["mask_fill_ms_per_step"] * 1.01


def test_naive_mask_mode_gives_the_same_tokens(tiny_model):
    """``grammar_mask_overlap=False`` (fill before launch) is an ablation: only the timing may differ."""
    common = {"model": str(tiny_model), "device": "cpu", "dtype": "float32", "max_num_seqs": 16}
    designed, _ = _run({**common, "grammar_mask_overlap": True}, 64)
    naive, _ = _run({**common, "grammar_mask_overlap": False}, 64)
    assert [o.token_ids for o in designed] == [o.token_ids for o in naive]


def test_grammar_rows_and_plain_rows_share_steps_without_changing_plain_tokens(tiny_model):
    common = {"model": str(tiny_model), "device": "cpu", "dtype": "float32", "max_num_seqs": 16,
              "engine_process": False}
    plain = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(8)]
    constrained = [SamplingParams(max_tokens=24, temperature=1.0, seed=i,
                                  structured_outputs=StructuredOutputsParams(regex=r"[ab]{3,9}")) for i in range(8)]
    with LLM(**common) as llm:
        alone = llm.generate(["plain"] * 8, plain, use_tqdm=False)
        mixed = llm.generate(["plain"] * 8 + ["regex"] * 8, plain + constrained, use_tqdm=False)
    assert [o.token_ids for o in alone] == [o.token_ids for o in mixed[:8]]
    for out in mixed[8:]:
        assert out.finish_reason == "stop"
        assert out.text and set(out.text) <= {"a", "b"} and 3 <= len(out.text) <= 9


def test_a_step_with_masks_to_fill_releases_its_drained_requests_after_the_fill(monkeypatch):
    """The sampling of step N+1 waits on its masks, filled once N is applied; releasing N+1's drained requests
    (and registering its prefill blocks) is not on that chain, so it waits until after the fill
    (``EngineCore.overlap_loop``): 256 requests draining at once took ~2 ms, twice the step."""
    from asyncbatch.engine import core

    events: list[tuple[str, int, int]] = []
    release, fill = core.EngineCore._release, core.EngineCore._fill_launched

    def logged_release(self, launched, awaited):
        events.append(("release", launched.plan.step_id, len(launched.plan.drained)))
        return release(self, launched, awaited)

    def logged_fill(self, step):
        events.append(("fill", step.plan.step_id, 0))
        return fill(self, step)

    monkeypatch.setattr(core.EngineCore, "_release", logged_release)
    monkeypatch.setattr(core.EngineCore, "_fill_launched", logged_fill)
    grammar = StructuredOutputsParams(regex="[ab]{30}")
    params = ([SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=grammar) for i in range(8)]
              + [SamplingParams(max_tokens=3 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(16)])
    with LLM(device="sim", engine_process=False, max_num_seqs=32, debug_check_integrity=True,
             sim=SimConfig(step_fixed_ms=0.5)) as llm:
        llm.generate(["compile it"], SamplingParams(max_tokens=2, structured_outputs=grammar), use_tqdm=False)
        events.clear()  # the grammar compiled: the rows below start together
        outputs = llm.generate([f"request {i}" for i in range(len(params))], params, use_tqdm=False)
    assert all(len(o.token_ids) == 3 + i for i, o in enumerate(outputs[8:]))
    assert all(o.finish_reason == "stop" and len(o.text) == 30 for o in outputs[:8])
    order: dict[int, dict[str, tuple[int, int]]] = {}
    for i, (kind, step, drained) in enumerate(events):
        order.setdefault(step, {})[kind] = (i, drained)
    both = [step for step, seen in order.items() if len(seen) == 2]
    assert sum(order[step]["release"][1] for step in both) >= 8, "steps with late masks were meant to drain requests"
    assert all(order[step]["fill"][0] < order[step]["release"][0] for step in both)


@pytest.mark.parametrize("kwargs, field", [
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "json"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= "}, "grammar"),
    ({"choice": []}, "choice"),
])
def test_bad_constraints_are_refused_at_submission_and_the_engine_serves_on(tiny_model, kwargs, field):
    with LLM(str(tiny_model), device="cpu", dtype="float32", max_num_seqs=4, engine_process=False) as llm:
        with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**kwargs)),
                         use_tqdm=False)
        out = llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no"])), use_tqdm=False)[0]
        assert out.text in ("yes", "no")


def test_the_structured_output_benchmark_runs_and_reports_every_configuration(tmp_path):
    """``scripts/bench_structured.py --quick``: the three configurations side by side, each with its busy
    fraction and, for the grammar ones, a measured mask time; no timing is asserted."""
    import json
    import sys
    from pathlib import Path

    from in_process import run_program

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_structured.py"
    proc = run_program([sys.executable, str(script), "--quick", "--out", str(tmp_path)])  # in_process.py: why
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "report.json").read_text())
    assert [r["config"] for r in results] == ["none", "overlap", "naive"]
    for r in results:
        assert 0.0 < r["device_busy_fraction"] <= 1.0 and r["steady_steps"] > 0
        assert (r["mask_fill_us_per_row"] > 0) == (r["config"] != "none")
        worst = r["worst_steps"]  # the idlest steps, idlest first, their share of the idle in [0, 1]
        assert [s["idle_ms"] for s in worst] == sorted((s["idle_ms"] for s in worst), reverse=True)
        assert 0.0 <= r["idle_share_worst_steps"] <= 1.0 + 1e-9
        assert len(worst) == min(10, r["steady_steps"] - 1)
        assert any(s["fill_cpu_ms"] > 0.0 for s in worst) == (r["config"] != "none")
        assert all(s["result_ms"] >= 0.0 and s["apply_ms"] > 0.0 for s in worst)
    assert "simulated" in (tmp_path / "report.md").read_text()


def test_the_benchmarks_rounds_are_summarised_by_medians_of_paired_ratios():
    """``bench_structured.py --rounds``: each figure's median over the rounds, the busy ratio the median of each
    round's ratio to that same round's ``none`` (not the ratio of the medians), the idlest steps the median round's."""
    from bench_structured import round_medians

    def run(config, rnd, busy, fill):
        return {"config": config, "step_ms": 1.0, "round": rnd, "device_busy_fraction": busy,
                "mask_fill_us_per_row": fill, "worst_steps": [{"step": rnd}], "idle_share_worst_steps": rnd / 10,
                "stagger_steps": 0}

    results = [run("none", 0, 1.0, 0.0), run("overlap", 0, 0.90, 2.0),
               run("overlap", 1, 0.76, 3.0), run("none", 1, 0.80, 0.0),
               run("none", 2, 0.90, 0.0), run("overlap", 2, 0.88, 2.5)]
    rows = round_medians(results)
    assert [r["config"] for r in rows] == ["none", "overlap"]
    none, overlap = rows
    assert overlap["busy_ratios"] == pytest.approx([0.90, 0.95, 0.88 / 0.90])
    assert overlap["busy_ratio"] == pytest.approx(0.95)  # the ratio of the medians would be 0.88 / 0.90
    assert overlap["device_busy_fraction"] == pytest.approx(0.88) and overlap["mask_fill_us_per_row"] == 2.5
    assert overlap["worst_steps"] == [{"step": 2}] and overlap["idle_share_worst_steps"] == 0.2
    assert overlap["rounds"] == 3
    assert none["busy_ratio"] == 1.0 and none["stagger_steps"] == 0


def test_the_benchmark_can_stagger_the_grammar_rows_arrivals(make_llm):
    """``bench_structured.py --stagger-steps``: the first ``staggered`` requests arrive in waves a step time
    apart (the others with the first wave), every request runs to its end, and outputs come in input order."""
    from bench_structured import submit_staggered

    llm = make_llm(device="sim", max_num_seqs=8, engine_process=False, sim=SimConfig(step_fixed_ms=1.0))
    params = [SamplingParams(max_tokens=3 + i, ignore_eos=True, seed=i) for i in range(6)]
    outs = submit_staggered(llm, [f"request {i}" for i in range(6)], params, staggered=4, stagger_steps=2,
                            step_ms=20.0)
    assert [len(o.token_ids) for o in outs] == [3 + i for i in range(6)]
    arrivals = [o.metrics.arrival_time for o in outs]
    first_wave, second_wave = [arrivals[i] for i in (0, 2, 4, 5)], [arrivals[i] for i in (1, 3)]
    assert min(second_wave) - max(first_wave) >= 0.019  # time.sleep(20 ms) between the two submissions
    together = submit_staggered(llm, ["a", "b"], params[:2], staggered=2, stagger_steps=0, step_ms=20.0)
    assert [len(o.token_ids) for o in together] == [3, 4]  # 0: all at once, through generate


@pytest.mark.parametrize("speculative", [None, {"method": "ngram"}, "draft_self"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_complete_grammar_stops_under_min_tokens_and_an_open_one_goes_on(make_llm, tiny_model, speculative,
                                                                          overlap):
    """``min_tokens`` bans EOS; a grammar that is complete allows only EOS. Then the grammar wins: the request
    stops with its whole constraint (``finish_reason="stop"``), as vLLM lets a terminal grammar stop, instead of
    sampling from an empty distribution (an error before). While the grammar can go on, ``min_tokens`` holds:
    no EOS before it."""
    if speculative == "draft_self":
        speculative = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3}
    llm = make_llm(str(tiny_model), device="cpu", dtype="float32", engine_process=False, overlap=overlap,
                   speculative_config=speculative)
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=3, min_tokens=min_tokens,
                             structured_outputs=StructuredOutputsParams(**constraint))
              for temperature in (0.0, 1.0)
              for constraint, min_tokens in (({"choice": ["ab"]}, 6), ({"regex": "(ab)+"}, 7),
                                             ({"json_object": True}, 18))]
    outs = llm.generate([[5, 6, 7]] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        constraint = p.structured_outputs
        assert out.finish_reason in ("stop", "length"), (constraint, out.finish_reason, out.error)
        if constraint.choice is not None:  # complete after two tokens, before min_tokens
            assert out.finish_reason == "stop" and out.text == "ab" and out.token_ids[-1] == 2
        elif constraint.regex is not None:  # can always go on: min_tokens holds
            assert len(out.token_ids) >= p.min_tokens and re.fullmatch("(ab)+", out.text)
            assert out.finish_reason == "length" or out.token_ids.index(2) >= p.min_tokens
        if out.finish_reason == "stop" and constraint.json_object:
            assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("speculative", [None, {"method": "ngram"}, "draft_self"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_complete_grammar_ends_an_ignore_eos_request(make_llm, tiny_model, speculative, overlap):
    """``ignore_eos`` keeps a request going past EOS, but a complete grammar allows nothing after its EOS: the
    request ends there with ``finish_reason="stop"`` (before, its next token was refused and it ended as an
    engine error). A row without a grammar still runs to ``max_tokens``."""
    if speculative == "draft_self":
        speculative = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3}
    llm = make_llm(str(tiny_model), device="cpu", dtype="float32", engine_process=False, overlap=overlap,
                   speculative_config=speculative)
    constraints = ({"choice": ["ab"]}, {"regex": "(ab){1,3}"}, {"json_object": True})
    params = [SamplingParams(max_tokens=12, temperature=temperature, seed=1, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(**constraint))
              for temperature in (0.0, 1.0) for constraint in constraints]
    params.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    outs = llm.generate([[5, 6, 7]] * len(params), params, use_tqdm=False)
    for out, p in zip(outs[:-1], params):
        assert out.finish_reason == "stop" and out.token_ids[-1] == 2, (p.structured_outputs, out.finish_reason)
        assert 2 not in out.token_ids[:-1]
    assert outs[0].text == "ab" and re.fullmatch("(ab){1,3}", outs[1].text)
    assert isinstance(json.loads(outs[2].text), dict)
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 12
