"""Sampling, stop conditions and streaming on the default model (CPU, float32)."""

from __future__ import annotations

import pytest

from asyncbatch import LLM, SamplingParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync"])
def llm(request):
    engine = LLM(device="cpu", dtype="float32", overlap=request.param, max_num_batched_tokens=256, max_num_seqs=64)
    yield engine
    engine.close()


PROMPT = "The history of the printing press begins"


def test_seeded_sampling_is_batch_invariant(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids
    others = [f"Story number {i}: once" for i in range(32)]
    crowd_params = [SamplingParams(max_tokens=4 + i % 9, temperature=1.0, seed=i) for i in range(32)]
    outs = llm.generate(others[:16] + [PROMPT] + others[16:], crowd_params[:16] + [params] + crowd_params[16:],
                        use_tqdm=False)
    assert outs[16].token_ids == alone
    different_seed = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.9, seed=99),
                                  use_tqdm=False)[0].token_ids
    assert different_seed != alone


def test_stop_string_cuts_text(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0]
    stop = base.text[10:14]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    assert base.token_ids[:len(out.token_ids)] == out.token_ids
    kept = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 16
    target = base.token_ids[5]
    first = base.token_ids.index(target)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[target]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == base.token_ids[:first + 1]
    # vLLM's rule: the stop token's text is in the output only with include_stop_str_in_output, whether the
    # text is decoded at the end (generate) or token by token (stream).
    kept_params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[target],
                                 include_stop_str_in_output=True)
    kept = llm.generate([PROMPT], kept_params, use_tqdm=False)[0]
    streamed = "".join(d.text for d in llm.stream(PROMPT, kept_params))
    assert kept.token_ids == out.token_ids and kept.stop_reason == target
    assert base.text.startswith(kept.text) and len(kept.text) > len(out.text) and base.text.startswith(out.text)
    assert streamed == kept.text


def test_min_tokens_keeps_an_early_stop_string_from_ending_the_output(llm):
    """vLLM's rule: a stop string counts only where it ends in the text of a token past ``min_tokens``."""
    base = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0]
    stop = base.text[:4]  # ends within the first tokens' text
    early = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0]
    assert early.text == "" and early.stop_reason == stop
    min_tokens = 6
    boundary = len(llm.tokenizer.decode(base.token_ids[:min_tokens], skip_special_tokens=True))
    assert boundary >= len(stop)
    later = base.text.find(stop, boundary - len(stop) + 1)  # the first occurrence that ends past the boundary
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop],
                                                min_tokens=min_tokens), use_tqdm=False)[0]
    if later < 0:
        assert out.finish_reason == "length" and out.text == base.text
    else:
        assert out.stop_reason == stop and out.text == base.text[:later]


def test_eos_and_ignore_eos(llm):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say just: hello"}], tokenize=False,
                                             add_generation_prompt=True)
    ids = llm.tokenizer.encode(chat, add_special_tokens=False)
    stopped = llm.generate([ids], SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids[-1] == llm.tokenizer.eos_token_id
    assert llm.tokenizer.eos_token not in stopped.text
    forced = llm.generate([ids], SamplingParams(max_tokens=len(stopped.token_ids) + 5, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == len(stopped.token_ids) + 5
    assert forced.token_ids[:len(stopped.token_ids)] == stopped.token_ids


def test_stream_deltas_concatenate_to_final_output(llm):
    params = SamplingParams(max_tokens=20, temperature=0.0, stop=["."])
    final = llm.generate([PROMPT], params, use_tqdm=False)[0]
    deltas = list(llm.stream(PROMPT, params))
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].finish_reason == final.finish_reason


def test_chat_refuses_malformed_messages_naming_them(llm):
    """Bad messages are a ValueError / TypeError naming ``messages`` (the template's own jinja error is the cause),
    and the engine serves the next request."""
    with pytest.raises(ValueError, match=r"^messages: the chat template failed .*UndefinedError"):
        llm.chat([{"role": "user"}], use_tqdm=False)  # no content: the template reads message['content']
    with pytest.raises(ValueError, match=r"messages\[1\] has no 'role'"):
        llm.chat([{"role": "user", "content": "hi"}, {"content": "x"}], use_tqdm=False)
    with pytest.raises(TypeError, match=r"messages\[0\] must be a dict"):
        llm.chat([["role", "user"]], use_tqdm=False)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.token_ids) >= 1


def test_chat_takes_vllms_template_arguments_and_stream_one_prompt(llm):
    """``LLM.chat``'s ``chat_template``, ``chat_template_kwargs`` and ``tools`` reach the template (vLLM's
    signature); ``stream`` given a list of prompts says it takes one."""
    template = "{% for m in messages %}[{{ m['role'] }}|{{ greeting }}|{{ tools | length }}] {{ m['content'] }}\n{% endfor %}"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                   add_generation_prompt=False, chat_template=template, chat_template_kwargs={"greeting": "hello"},
                   tools=tools)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("[user|hello|1] hi\n", add_special_tokens=False)
    with pytest.raises(TypeError, match="stream takes one prompt"):
        next(iter(llm.stream(["a", "b"])))


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=8, temperature=0.0),
                   use_tqdm=False)[0]
    template = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(template, add_special_tokens=False)
    assert out.metrics.ttft is not None and out.metrics.latency >= out.metrics.ttft
