"""A request the scheduler cannot place fails alone, with a clear error; the engine keeps serving.

The input processor refuses such requests at the door (``test_bad_input``); these are forged past it
(``EngineClient.submit`` takes a ``ProcessedRequest`` as it is), so only the engine core's own guard stands
between them and the planner. Before, its refusal escaped the planner thread and killed the engine.
"""

from __future__ import annotations

import pytest

from asyncbatch import LLM, SamplingParams, SimConfig
from asyncbatch.frontend.input_processor import ProcessedRequest

FIXED = SimConfig(step_fixed_ms=0.05, per_token_us=0.0, per_context_token_ns=0.0,
                  output_len_distribution="fixed", output_len_max=10_000)
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
NUM_KV_BLOCKS = 12  # 11 usable: 44 tokens, fewer than one request may hold by max_model_len


@pytest.fixture(scope="module", params=[True, False], ids=["core-process", "in-process"])
def llm(request):
    engine = LLM(device="sim", sim=FIXED, engine_process=request.param, max_model_len=MAX_MODEL_LEN,
                 block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, debug_check_integrity=True)
    yield engine
    engine.close()


def forged(num_prompt: int, max_tokens: int) -> ProcessedRequest:
    return ProcessedRequest(None, [300] * num_prompt, SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize(("num_prompt", "max_tokens"), [
    (8, MAX_MODEL_LEN),  # longer than one request's block table
    (8, 40),  # fits the table, but not the whole cache: it could never run
], ids=["too-long", "never-fits-the-cache"])
def test_a_forged_request_fails_alone(llm, num_prompt, max_tokens):
    ok = llm.processor.process([300] * 4, SamplingParams(max_tokens=6))
    with pytest.raises(ValueError):  # the door refuses it...
        llm.processor.request(forged(num_prompt, max_tokens).prompt_token_ids, SamplingParams(max_tokens=max_tokens))
    before, bad, after = llm.submit([ok, forged(num_prompt, max_tokens), ok])  # ...so forge it past the door
    out = bad.wait(timeout=30)
    assert out.finish_reason == "error"
    assert "refused" in out.error and "max_tokens" in out.error, out.error
    assert out.token_ids == []
    for neighbour in (before, after):
        result = neighbour.wait(timeout=30)
        assert result.finish_reason == "length" and len(result.token_ids) == 6
    assert llm.alive
    assert llm.generate([[300] * 4], SamplingParams(max_tokens=3), use_tqdm=False)[0].finish_reason == "length"
    llm.check_integrity()
    assert llm.num_free_blocks == llm.num_usable_blocks


def test_a_forged_stream_raises_the_refusal(llm):
    handle = llm.submit([forged(8, MAX_MODEL_LEN)], streaming=True)[0]
    item = handle.deltas.get(timeout=30)
    assert isinstance(item, Exception) and "refused" in str(item)
    assert llm.alive
