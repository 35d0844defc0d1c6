"""The frontend over verify steps: several tokens a row (``StepOutputs.num_tokens``) give what one token a row
gives.

A speculative engine hands the frontend each row's emitted tokens as one run; a ``token_only`` request takes
them in one ``extend``, the others token by token. On the simulated device a speculative run emits exactly
the plain run's tokens, so every caller-visible output must equal the plain run's: token ids, text (EOS
hidden), finish and stop reasons, streamed deltas, and stop strings found in the middle of a run (the tokens
after the stop in the same run are dropped).
"""

from __future__ import annotations

import pytest

from asyncbatch.config import SimConfig
from asyncbatch.sampling_params import SamplingParams

SIM = SimConfig(step_fixed_ms=0.05, per_token_us=0.0, per_context_token_ns=0.0, output_len_min=10, output_len_max=60)
SPEC = {"num_speculative_tokens": 4, "disable_by_batch_size": None}
PROMPTS = [[300 + i, 400 + i, 500 + i, 600 + i] for i in range(24)]


def _params(stops: dict[int, str]) -> list[SamplingParams]:
    params = []
    for i in range(len(PROMPTS)):
        kind = i % 4
        if kind == 0:  # token_only, EOS honoured (hidden in the text)
            params.append(SamplingParams(max_tokens=50, temperature=0.0, seed=i))
        elif kind == 1:  # token_only past EOS
            params.append(SamplingParams(max_tokens=40, temperature=0.0, seed=i, ignore_eos=True))
        elif kind == 2:  # a stop id
            params.append(SamplingParams(max_tokens=50, temperature=0.0, seed=i, stop_token_ids=[300 + i]))
        else:  # a stop string from the middle of its plain output
            params.append(SamplingParams(max_tokens=50, temperature=0.0, seed=i, stop=[stops[i]] if i in stops
                                         else None))
    return params


def _view(outs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]


def test_verify_steps_give_the_frontend_what_plain_steps_give(make_llm) -> None:
    plain = make_llm(device="sim", sim=SIM, engine_process=False, max_num_seqs=32)
    free = plain.generate(PROMPTS, _params({}), use_tqdm=False)
    stops = {i: free[i].text[len(free[i].text) // 2:][:2] for i in range(3, len(PROMPTS), 4)}
    stops = {i: s for i, s in stops.items() if s.strip()}
    if not stops:
        pytest.skip("the pseudo-tokens' text has no usable stop string")
    params = _params(stops)
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    streamed_plain = list(plain.stream(PROMPTS[3], params[3]))

    spec = make_llm(device="sim", sim=SIM, engine_process=False, max_num_seqs=32, speculative_config=SPEC,
                    debug_check_integrity=True)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    streamed = list(spec.stream(PROMPTS[3], params[3]))
    spec.wait_settled(5.0)

    assert _view(got) == _view(expected)
    assert any(o.finish_reason == "stop" and isinstance(o.stop_reason, str) for o in got)
    assert [t for d in streamed for t in d.token_ids] == [t for d in streamed_plain for t in d.token_ids]
    assert "".join(d.text for d in streamed) == "".join(d.text for d in streamed_plain)
    stats = spec.stats()
    assert stats["spec_decode_mean_acceptance_length"] > 1.5
    assert stats["output_tokens"] == sum(len(o.token_ids) for o in got) + len(streamed[-1].output.token_ids)
