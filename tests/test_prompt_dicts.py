"""vLLM's prompt dicts (``TextPrompt``, ``TokensPrompt``, with ``cache_salt``) through ``LLM`` and ``AsyncLLM``."""

from __future__ import annotations

import asyncio

import pytest

from asyncbatch import SamplingParams
from asyncbatch.frontend.input_processor import unpack_prompt
from asyncbatch.serve.async_llm import AsyncLLM

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, seed=1)  # sim: tokens from the seed


def test_prompt_dicts_give_the_plain_prompts_outputs(make_llm):
    llm = make_llm("smollm2-135m", device="sim", engine_process=False)
    ids = llm.processor.prompt_ids("The capital of France is")
    plain = llm.generate(["The capital of France is", ids], GREEDY, use_tqdm=False)
    dicts = llm.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}], GREEDY,
                         use_tqdm=False)
    assert [o.prompt_token_ids for o in dicts] == [o.prompt_token_ids for o in plain]
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert dicts[0].prompt == "The capital of France is" and dicts[1].prompt is None
    assert dicts[1].prompt_token_ids == ids
    (single,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)  # one dict, not in a list
    assert single.token_ids == plain[1].token_ids


def test_a_prompt_dicts_cache_salt_separates_its_prefix_blocks(make_llm):
    """The salt in the dict does what ``SamplingParams.cache_salt`` does (``test_prefix_cache_tokens``), per
    prompt, with one shared ``SamplingParams`` left as it was."""
    llm = make_llm("smollm2-135m", device="sim", skip_tokenizer_init=True, engine_process=False, block_size=16)
    prompt = list(range(100, 164))  # four full blocks

    def cached(entry) -> int:
        before = llm.prefix_cache_stats()["cached_tokens"]
        llm.generate([entry], GREEDY, use_tqdm=False)
        return llm.prefix_cache_stats()["cached_tokens"] - before

    assert cached({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}) == 0
    assert cached({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}) == 0
    assert cached(prompt) == 0  # no salt: its own blocks
    assert cached({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}) == 48
    assert cached({"prompt_token_ids": prompt}) == 48  # a dict without a salt is the plain prompt
    assert GREEDY.cache_salt is None


def test_the_async_api_takes_prompt_dicts():
    async def run() -> list[list[int]]:
        async with AsyncLLM("smollm2-135m", device="sim", skip_tokenizer_init=True, engine_process=False) as engine:
            outs = []
            for prompt in ([5, 6, 7, 8], {"prompt_token_ids": [5, 6, 7, 8], "cache_salt": "s"}):
                async for delta in engine.generate(prompt, GREEDY):
                    if delta.finish_reason:
                        outs.append(delta.output.token_ids)
            return outs

    plain, salted = asyncio.run(run())
    assert plain == salted and len(plain) == GREEDY.max_tokens


@pytest.mark.parametrize("prompt,params,error,match", [
    ({"prompt": "hi", "multi_modal_data": {}}, None, ValueError, r"got \['multi_modal_data'\] \(the engine runs"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, None, ValueError, "exactly one of 'prompt'"),
    ({}, None, ValueError, "exactly one of 'prompt'"),
    ({"prompt": [1, 2]}, None, TypeError, "'prompt' must be a string, got list"),
    ({"prompt_token_ids": "hi"}, None, TypeError, "'prompt_token_ids' must be a list of ints, got str"),
    ({"prompt": "hi", "cache_salt": ""}, None, ValueError, "cache_salt must be a non-empty string"),
    ({"prompt": "hi", "cache_salt": "a"}, SamplingParams(cache_salt="b"), ValueError, "cache_salt is given twice"),
])
def test_a_bad_prompt_dict_names_what_is_wrong(prompt, params, error, match):
    with pytest.raises(error, match=match):
        unpack_prompt(prompt, params)


def test_a_bad_prompt_dict_queues_nothing(make_llm):
    llm = make_llm("smollm2-135m", device="sim", skip_tokenizer_init=True, engine_process=False)
    with pytest.raises(ValueError, match="multi-modal"):
        llm.generate([[5, 6], {"prompt_token_ids": [5, 6], "multi_modal_data": {"image": None}}], GREEDY,
                     use_tqdm=False)
    assert llm.num_requests() == (0, 0)


def test_the_same_salt_in_the_dict_and_the_params_is_allowed():
    shared = SamplingParams(cache_salt="a")
    assert unpack_prompt({"prompt": "x", "cache_salt": "a"}, shared) == ("x", shared)
    prompt, params = unpack_prompt({"prompt_token_ids": [1, 2], "cache_salt": "b"}, None)
    assert prompt == [1, 2] and params.cache_salt == "b"
