"""Bad input is refused at submission with an error naming the field; the engine keeps serving.

Each case is tried while a neighbour request is running on the same engine,
and the neighbour must finish with the same tokens as it does alone.
"""

from __future__ import annotations

import threading

import pytest
from reference import assert_bfloat16_runs_agree
from tiny_models import TINY_VOCAB, save_tiny_model

from asyncbatch import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM")


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync"])
def engine(request, tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", overlap=request.param, max_model_len=96, num_kv_blocks=64,
              block_size=4, debug_check_integrity=True)
    yield llm
    llm.close()


NEIGHBOUR = [5, 6, 7, 8, 9]
NEIGHBOUR_PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

BAD_PARAMS = [
    ({"temperature": -0.1}, ValueError, "temperature"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": -2}, ValueError, "top_k"),
    ({"min_p": 1.5}, ValueError, "min_p"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"max_tokens": -5}, ValueError, "max_tokens"),
    ({"max_tokens": 2.5}, TypeError, "max_tokens"),
    ({"max_tokens": "10"}, TypeError, "max_tokens"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"seed": -1}, ValueError, "seed"),
    ({"seed": 2**64}, ValueError, "seed"),
    ({"stop": [""]}, ValueError, "stop"),
    ({"stop": [1, 2]}, TypeError, "stop"),
    ({"stop_token_ids": [-3]}, ValueError, "stop_token_ids"),
    ({"stop_token_ids": "abc"}, TypeError, "stop_token_ids"),
    ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
    ({"presence_penalty": 3.0}, ValueError, "presence_penalty"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
]


@pytest.mark.parametrize("kwargs,error,field", BAD_PARAMS, ids=[str(k) for k, _, _ in BAD_PARAMS])
def test_invalid_sampling_params_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


BAD_PROMPTS = [
    (None, TypeError, "prompt"),
    (42, TypeError, "prompt"),
    ("", ValueError, "empty"),
    ([], ValueError, "empty"),
    ([[1, 2], [3]], TypeError, "nested"),
    ([1, "a"], TypeError, "token ids"),
    ([1, -4], ValueError, r"\[0, "),
    ([1, TINY_VOCAB], ValueError, r"\[0, "),
    ([True, 2], TypeError, "token ids"),
    ({"text": "hi"}, TypeError, "prompt"),
]


def neighbour_alone(engine) -> list[int]:
    return engine.generate([NEIGHBOUR], NEIGHBOUR_PARAMS, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("prompt,error,match", BAD_PROMPTS, ids=[repr(p)[:20] for p, _, _ in BAD_PROMPTS])
def test_invalid_prompts_are_refused_and_neighbour_finishes(engine, prompt, error, match):
    expected = neighbour_alone(engine)
    stream = engine.stream(NEIGHBOUR, NEIGHBOUR_PARAMS)
    with pytest.raises(error, match=match):
        engine.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert [t for d in stream for t in d.token_ids] == expected
    assert engine.generate([NEIGHBOUR], NEIGHBOUR_PARAMS, use_tqdm=False)[0].token_ids == expected


def test_requests_that_can_never_fit_are_refused(engine):
    expected = neighbour_alone(engine)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[5] * 90], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate([[5]], SamplingParams(max_tokens=10**9), use_tqdm=False)
    assert neighbour_alone(engine) == expected


def test_a_bad_prompt_in_a_batch_queues_nothing(engine):
    with pytest.raises(ValueError):
        engine.generate([NEIGHBOUR, [], NEIGHBOUR], NEIGHBOUR_PARAMS, use_tqdm=False)
    engine.check_integrity()
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_unknown_engine_keyword_is_a_type_error(tiny_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_dir), device="cpu", max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(tiny_dir), device="cpu", max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="device"):
        LLM(str(tiny_dir), device="tpu")


def generate_from_threads(engine, threads: int = 6, each: int = 3) -> list[list[int]]:
    """The neighbour's tokens from ``threads`` threads calling ``generate`` ``each`` times at once."""
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def worker():
        try:
            for _ in range(each):
                results.append(engine.generate([NEIGHBOUR], NEIGHBOUR_PARAMS, use_tqdm=False)[0].token_ids)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not errors
    assert len(results) == threads * each
    return results


def test_generate_from_several_threads(engine):
    expected = neighbour_alone(engine)
    results = generate_from_threads(engine)
    assert all(r == expected for r in results)


def test_generate_from_several_threads_bfloat16(tiny_dir):
    """In bfloat16 the neighbour's logits depend on how many copies share its step (docs/reproducibility.md):
    every thread's tokens equal the lone run's up to a near-tie."""
    with LLM(str(tiny_dir), device="cpu", dtype="bfloat16", overlap=True, max_model_len=96, num_kv_blocks=64,
             block_size=4, debug_check_integrity=True) as engine:
        expected = neighbour_alone(engine)
        results = generate_from_threads(engine)
        engine.check_integrity()
    assert_bfloat16_runs_agree(tiny_dir, "threads vs alone", [NEIGHBOUR] * len(results), results,
                               [expected] * len(results))
