"""``scripts/mixed_features_check.py``: every sampler feature mixed in one batch, overlap against the other modes.

One drawn iteration on a tiny random model (float32) runs clean under overlap against synchronous mode and
n-gram speculation; the comparison and the constraint checks are shown to catch what they are for.
"""

from __future__ import annotations

import dataclasses

import pytest
from mixed_features_check import constraint_violations, draw, main, outputs_differ
from tiny_models import save_tiny_model

from asyncbatch import SamplingParams
from asyncbatch.outputs import CompletionOutput, Logprobs, RequestOutput

pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (pip install .[structured])")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("mixed") / "llama", "LlamaForCausalLM",
                           max_position_embeddings=256)


def test_one_iteration_has_no_difference_between_overlap_sync_and_speculation(tiny_model, capsys):
    # Seed 3: 9 requests (3 structured, 2 with logprobs, 3 with prompt logprobs, one n = 2, one min_tokens) with
    # chunked prefill and prefix caching.
    it = draw(3, vocab_size=300)
    assert len(it.params) == 9 and it.engine["enable_prefix_caching"] and "max_num_batched_tokens" in it.engine
    assert sum(p.structured_outputs is not None for p in it.params) == 3
    assert any(p.n > 1 for p in it.params) and any(p.logprobs is not None for p in it.params)
    assert main(["--device", "cpu", "--model", str(tiny_model), "--iterations", "1", "--seed", "3",
                 "--speculative"]) == 0
    assert "1 of 1 iterations without a difference" in capsys.readouterr().out


def test_the_draws_mix_every_feature():
    params = [p for seed in range(10) for p in draw(seed, vocab_size=300).params]
    for field, empty in [("logprobs", None), ("prompt_logprobs", None), ("logit_bias", None), ("min_tokens", 0),
                         ("structured_outputs", None), ("allowed_token_ids", None), ("stop", None), ("n", 1)]:
        assert any(getattr(p, field) != empty for p in params), field
    assert draw(7, 300) == draw(7, 300)  # a function of the seed


def _output(tokens: list[int], logprobs: list[float], top: list[list[int]], finish: str = "length",
            text: str = "x") -> RequestOutput:
    lp = Logprobs(tokens, logprobs, [1] * len(tokens), top, [[v] * len(ids) for v, ids in zip(logprobs, top)])
    return RequestOutput("r", None, [1, 2], text, tokens, finish, logprobs=lp)


def test_the_comparison_catches_tokens_logprobs_and_top_ids():
    a = _output([5, 6], [-1.0, -2.0], [[5, 9], [6, 9]])
    assert outputs_differ(a, _output([5, 6], [-1.0, -2.0], [[5, 9], [6, 9]]), 2e-4) is None
    assert outputs_differ(a, _output([5, 6], [-1.0001, -2.0], [[5, 9], [6, 9]]), 2e-4) is None  # within it
    assert outputs_differ(a, _output([5, 6], [-1.0, -2.0], [[9, 5], [6, 9]]), 2e-4) is None  # a tie's order
    assert "tokens" in outputs_differ(a, _output([5, 7], [-1.0, -2.0], [[5, 9], [6, 9]]), 2e-4)
    assert "finish" in outputs_differ(a, _output([5, 6], [-1.0, -2.0], [[5, 9], [6, 9]], "stop"), 2e-4)
    assert "a logprob" in outputs_differ(a, _output([5, 6], [-1.0, -2.01], [[5, 9], [6, 9]]), 2e-4)
    assert "top ids" in outputs_differ(a, _output([5, 6], [-1.0, -2.0], [[5, 8], [6, 9]]), 2e-4)
    assert outputs_differ(a, _output([5, 6], [-1.0, -2.01], [[5, 9], [6, 9]]), None) is None  # tokens only
    more = dataclasses.replace(a, more_outputs=[CompletionOutput(1, "x", [5], None, None, "length")])
    assert "number of completions" in outputs_differ(a, more, 2e-4)
    assert "completion 1" in outputs_differ(more, dataclasses.replace(
        a, more_outputs=[CompletionOutput(1, "x", [7], None, None, "length")]), 2e-4)


def test_the_constraint_checks_catch_a_bad_grammar_stop_and_a_short_output():
    from harness.structured_cases import CASES

    case = next(c for c in CASES if c.params.json is not None)
    grammar = SamplingParams(max_tokens=20, structured_outputs=case.params)
    assert constraint_violations(grammar, _output([1], [-1.0], [[1]], "stop", text="not json"))
    assert constraint_violations(grammar, _output([1], [-1.0], [[1]], "length", text="not json")) == []
    short = SamplingParams(max_tokens=20, min_tokens=3, stop=["a"])
    assert constraint_violations(short, dataclasses.replace(_output([1], [-1.0], [[1]], "stop"), stop_reason="a"))
    assert constraint_violations(short, _output([1, 2, 3], [-1.0] * 3, [[1]] * 3, "stop")) == []
    # A grammar may end a request under its min_tokens (EOS, no stop reason), stop strings or not.
    choice = next(c for c in CASES if c.params.choice)
    ended = SamplingParams(max_tokens=20, min_tokens=8, stop=["a"], structured_outputs=choice.params)
    text = choice.params.choice[0]
    assert constraint_violations(ended, _output([1, 2], [-1.0] * 2, [[1]] * 2, "stop", text=text)) == []
    assert constraint_violations(ended, _output([1, 2], [-1.0] * 2, [[1]] * 2, "stop", text="maybe"))
