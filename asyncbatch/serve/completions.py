"""``POST /v1/completions``: text (or token-id) prompts in, completions out, JSON or SSE.

``logprobs: k`` adds OpenAI's legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` per choice
(per chunk when streaming, the offsets running on); with ``echo`` the prompt's tokens come first
(``logprobs_format``; streamed, in each choice's first chunk, with its first tokens). vLLM's ``prompt_logprobs``
adds ``choices[].prompt_logprobs``.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncbatch.outputs import StreamDelta
from asyncbatch.serve.generation import Generation, SSEResponse
from asyncbatch.serve.logprobs_format import CompletionLogprobs, token_texts, vllm_prompt_logprobs
from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.protocol import CompletionRequest
from asyncbatch.serve.sampling import (
    check_supported,
    compile_constraint,
    completion_prompt_logprobs,
    naming_constraint_errors,
    sampling_params,
    structured_outputs,
)
from asyncbatch.serve.state import ServerState

_OBJECT = "text_completion"


def split_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.check_model(body.model)
    check_supported(body)
    engine = state.engine
    prompts = split_prompts(body.prompt)
    structured, source = structured_outputs(body)
    params = sampling_params(body, 16 if body.max_tokens is None else body.max_tokens,
                             defaults=engine.processor.sampling_defaults, logprobs=body.logprobs,
                             prompt_logprobs=completion_prompt_logprobs(body), structured=structured)
    await compile_constraint(engine, params[0], source)
    state.admit(len(prompts) * body.n)
    whole = [await engine.prompt_ids(p, body.add_special_tokens) for p in prompts]
    prompt_ids = [engine.processor.truncated(ids, params[0]) for ids in whole]  # truncate_prompt_tokens
    # The echo is the prompt the model saw: the kept tokens' text where truncate_prompt_tokens cut it.
    echo = [(_prompt_text(p if len(ids) == len(w) else ids, engine.tokenizer) if body.echo else "")
            for p, ids, w in zip(prompts, prompt_ids, whole) for _ in range(body.n)]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    flat_ids = [ids for ids in prompt_ids for _ in range(body.n)]
    with naming_constraint_errors(source):
        requests = engine.submit_ids(flat_ids, params * len(prompts),
                                     [f"{response_id}-{k}" for k in range(len(flat_ids))],
                                     [p for p in prompts for _ in range(body.n)])
    return_ids = body.return_token_ids if body.return_token_ids is not None else engine.tokenizer is None
    gen = Generation(state, response_id, model, requests, sum(len(ids) for ids in prompt_ids),
                     include_usage=bool(body.stream_options and body.stream_options.include_usage),
                     continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
                     choices_per_prompt=body.n)
    texts = token_texts(engine.tokenizer)
    top = body.logprobs
    if body.stream:
        head = gen.chunk_head(_OBJECT)
        # With logprobs the echoed prompt goes with a choice's first delta, which brings the prompt's logprobs
        # (vLLM's order); without, in a chunk of its own before any token.
        pending = [bool(text) and top is not None for text in echo]
        # text_offset runs on over the tokens' strings, as in the whole response (logprobs_format), so a stream's
        # offsets are the response's even where the detokenizer held a split character back for a chunk.
        offsets = [0] * len(echo)

        def chunk(index: int, delta: StreamDelta) -> dict:
            text, logprobs, prompt = delta.text, None, None
            if pending[index]:
                pending[index] = False
                text = echo[index] + text
                prompt_lp = delta.prompt_logprobs
                if prompt_lp is None and delta.output is not None:  # ended before its first token
                    prompt_lp = delta.output.prompt_logprobs
                prompt = (flat_ids[index], prompt_lp)
            if top is not None and (delta.token_ids or prompt is not None):
                builder = CompletionLogprobs(texts, top, offsets[index])
                logprobs = builder.build(delta.logprobs, prompt)
                offsets[index] = builder.offset
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
            if return_ids:
                choice["token_ids"] = delta.token_ids
            return {**head, "choices": [choice]}

        # The echoed prompt leads each choice, in a chunk with every field the later ones have (no tokens yet).
        first = [{**head, "choices": [{"index": k, "text": text, "logprobs": None, "finish_reason": None,
                                       "stop_reason": None, **({"token_ids": []} if return_ids else {})}]}
                 for k, text in enumerate(echo) if text and not pending[k]]
        return SSEResponse(gen.sse(_OBJECT, first, chunk))
    outputs = await gen.collect(request)
    choices = []
    for k, output in enumerate(outputs):
        logprobs = None
        if top is not None:
            prompt = (output.prompt_token_ids, output.prompt_logprobs) if body.echo else None
            logprobs = CompletionLogprobs(texts, top).build(output.logprobs, prompt)
        choice = {"index": k, "text": echo[k] + output.text, "logprobs": logprobs,
                  "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs, texts,
                                                             body.prompt_logprobs)
        if return_ids:
            choice["token_ids"] = output.token_ids
            choice["prompt_token_ids"] = output.prompt_token_ids
        choices.append(choice)
    return JSONResponse({**gen.chunk_head(_OBJECT), "choices": choices, "usage": gen.usage(final=True)})


def _prompt_text(prompt: str | list[int], tokenizer) -> str:
    if isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise OpenAIError(400, "echo of a token-id prompt needs a tokenizer", param="echo")
    return tokenizer.decode(prompt)
