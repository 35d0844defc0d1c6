"""vLLM's ``RequestOutput.num_cached_tokens`` and OpenAI's ``usage.prompt_tokens_details.cached_tokens``: the prompt
tokens a request's first admission reused from the prefix cache, checked against ``prefix_cache_stats()``.

``sim`` with 16-token blocks: a prompt of 64 tokens seen before reuses 48 (every full block but the one holding
its last token, which is computed again to sample from); one that shares two blocks reuses 32. In the core
process the counts cross ``step_wire``; in-process they do not, so both run.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_checks import assert_idle_and_clean

from asyncbatch import SamplingParams
from asyncbatch.engine import step_wire
from asyncbatch.engine.messages import StepOutputs

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True, seed=5)
PROMPT = list(range(200, 264))  # four full blocks
SHARES_TWO = PROMPT[:32] + list(range(900, 940))  # two of them, then its own


@pytest.mark.parametrize("engine_process", [True, False], ids=["core-process", "in-process"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_each_output_says_what_its_first_admission_reused(make_llm, overlap, engine_process):
    llm = make_llm("smollm2-135m", device="sim", overlap=overlap, engine_process=engine_process, block_size=16,
                   skip_tokenizer_init=True, debug_check_integrity=True)

    def cached(prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[int | None]:
        before = llm.prefix_cache_stats()["cached_tokens"]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        counts = [o.num_cached_tokens for o in outs]
        assert sum(counts) == llm.prefix_cache_stats()["cached_tokens"] - before  # the engine's own counter
        return counts

    assert cached([PROMPT]) == [0]
    assert cached([PROMPT]) == [48]
    assert cached([SHARES_TWO, list(range(5000, 5020))]) == [32, 0]
    # n = 2: the second completion waits a step for the blocks the first computes (prefix_sharing) and reuses
    # them; the merged output reports the first completion's, as vLLM's parent request does.
    fresh = list(range(7000, 7064))
    out = llm.generate([{"prompt_token_ids": fresh}], SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=5),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.outputs) == 2
    assert llm.prefix_cache_stats()["deferred_admissions"] >= 1
    assert_idle_and_clean(llm)


def test_no_prefix_cache_reports_zero(make_llm):
    llm = make_llm("smollm2-135m", device="sim", enable_prefix_caching=False, skip_tokenizer_init=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, PARAMS, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]


def test_the_wire_carries_the_counts_only_where_some_were_reused():
    empty = np.zeros(0, dtype=np.int64)
    first = np.array([3, 4], dtype=np.int64)
    with_counts = StepOutputs(7, empty, empty, np.zeros(0, dtype=np.int8), empty, np.zeros(0, dtype=np.int8), first,
                              first_cached=np.array([48, 0], dtype=np.int64))
    back = step_wire.decode(step_wire.encode(with_counts))
    assert back.first_scheduled.tolist() == [3, 4] and back.first_cached.tolist() == [48, 0]
    without = StepOutputs(7, empty, empty, np.zeros(0, dtype=np.int8), empty, np.zeros(0, dtype=np.int8), first)
    assert step_wire.decode(step_wire.encode(without)).first_cached is None

