"""``POST /v1/chat/completions``: messages under the chat template in, an assistant message out.

With ``tools`` (``tool_calls``) the tools go into the prompt, ``required`` / a named function constrain the
output with a JSON schema, and each choice's text goes through a ``tool_parser`` parser: what it recognises
becomes ``message.tool_calls`` (``delta.tool_calls`` when streaming) and ``finish_reason`` ``"tool_calls"``.
``logprobs`` / ``top_logprobs`` add OpenAI's ``{"content": [...]}`` per choice, per chunk when streaming
(``logprobs_format``).
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncbatch.frontend.input_processor import ChatTemplateError
from asyncbatch.outputs import RequestOutput, StreamDelta
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.serve.generation import Generation, SSEResponse
from asyncbatch.serve.logprobs_format import chat_logprobs as format_logprobs
from asyncbatch.serve.logprobs_format import token_texts, vllm_prompt_logprobs
from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.protocol import ChatCompletionRequest, ChatMessage
from asyncbatch.serve.sampling import (
    chat_logprobs,
    chat_max_tokens,
    check_supported,
    compile_constraint,
    naming_constraint_errors,
    sampling_params,
    structured_outputs,
)
from asyncbatch.serve.state import ServerState
from asyncbatch.serve.tool_calls import ToolPlan, plan_tools, template_inputs, template_supports_tools
from asyncbatch.serve.tool_parser import parse_whole

_OBJECT = "chat.completion.chunk"


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them: text parts joined into one string."""
    out = []
    for message in messages:
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            item["content"] = "".join(part.text for part in message.content)
        out.append(item)
    return out


def chat_prompt_ids(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
    """The conversation's token ids under the chat template, with the tools of ``plan`` (``tool_calls``)."""
    processor = state.engine.processor
    if body.chat_template is not None and not state.settings.trust_request_chat_template:
        raise OpenAIError(400, "chat_template: this server does not take a request's own chat template (start it "
                               "with --trust-request-chat-template)", param="chat_template")
    template = body.chat_template or getattr(processor.tokenizer, "chat_template", None)
    messages, tool_kwargs = template_inputs(template_messages(body.messages), plan,
                                            template_supports_tools(template))
    # chat_template_kwargs may set the two switches too, and win over the fields (as in vLLM).
    kwargs = {**tool_kwargs, **(body.chat_template_kwargs or {})}
    if body.chat_template is not None:
        kwargs["chat_template"] = body.chat_template
    generation = bool(kwargs.pop("add_generation_prompt", body.add_generation_prompt))
    continued = bool(kwargs.pop("continue_final_message", body.continue_final_message))
    try:  # the processor's ValueErrors (both switches set, no messages) are 400s naming their field
        return processor.chat_prompt_ids(messages, generation, continued, body.add_special_tokens, **kwargs)
    except ChatTemplateError as exc:
        raise OpenAIError(400, str(exc).removeprefix("messages: "),
                          param="chat_template" if body.chat_template is not None else "messages") from exc


def _finish_reason(reason: str | None, called: bool, plan: ToolPlan | None) -> str | None:
    """OpenAI's (and vLLM's): ``tool_calls`` where ``auto`` or ``required`` made calls and the output ended
    normally; a named function's forced call ends in ``stop``; ``length`` stays."""
    return "tool_calls" if called and reason == "stop" and plan is not None and plan.mode != "named" else reason


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.check_model(body.model)
    check_supported(body)
    engine = state.engine
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    structured, source = structured_outputs(body, plan.schema() if plan is not None else None)
    ids = await engine.prompt_ids(chat_prompt_ids(state, body, plan))  # checked against the model's vocabulary
    if body.truncate_prompt_tokens is not None:  # the last k tokens (SamplingParams checks k: a 400 naming it)
        ids = engine.processor.truncated(ids, SamplingParams(truncate_prompt_tokens=body.truncate_prompt_tokens))
    max_tokens = chat_max_tokens(body)
    if max_tokens is None:  # OpenAI: as many as the context allows
        room = engine.processor.usable_context - len(ids)
        if room < 1:
            raise OpenAIError(400, f"the messages take {len(ids)} tokens, which leaves no room in the "
                              f"context of {engine.max_model_len} tokens", param="messages")
        max_tokens = room
    top = chat_logprobs(body)
    params = sampling_params(body, max_tokens, defaults=engine.processor.sampling_defaults, logprobs=top,
                             prompt_logprobs=body.prompt_logprobs, structured=structured)
    await compile_constraint(engine, params[0], source)
    state.admit(body.n)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    with naming_constraint_errors(source):
        requests = engine.submit_ids([ids] * body.n, params, [f"{response_id}-{k}" for k in range(body.n)])
    return_ids = bool(body.return_token_ids)
    texts = token_texts(engine.tokenizer)
    gen = Generation(state, response_id, model, requests, len(ids),
                     include_usage=bool(body.stream_options and body.stream_options.include_usage),
                     continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
                     choices_per_prompt=body.n)
    if body.stream:
        head = gen.chunk_head(_OBJECT)
        parsers = [plan.parser() for _ in range(body.n)] if plan is not None else None

        def chunk(index: int, delta: StreamDelta) -> dict | None:
            message: dict = {}
            called = False
            if parsers is not None:
                parsed = parsers[index].feed(delta.text)
                if delta.finish_reason is not None:
                    parsed.add(parsers[index].finish())
                if parsed.content:
                    message["content"] = parsed.content
                if parsed.calls:
                    message["tool_calls"] = [part.as_chunk() for part in parsed.calls]
                called = parsers[index].calls > 0
            elif delta.text:
                message["content"] = delta.text
            logprobs = format_logprobs(delta.logprobs, texts, top) if top is not None and delta.token_ids else None
            if not message and logprobs is None and delta.finish_reason is None and not return_ids:
                return None  # text held back (a tool call being parsed, a possible stop string): no empty chunk
            choice = {"index": index, "delta": message, "logprobs": logprobs,
                      "finish_reason": _finish_reason(delta.finish_reason, called, plan)}
            if delta.finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            if return_ids:
                choice["token_ids"] = delta.token_ids
            return {**head, "choices": [choice]}

        first = [{**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}]} for k in range(body.n)]
        return SSEResponse(gen.sse(_OBJECT, first, chunk))
    outputs = await gen.collect(request)
    choices = [_choice(k, output, plan, top, texts, return_ids) for k, output in enumerate(outputs)]
    response = {**gen.chunk_head("chat.completion"), "choices": choices, "usage": gen.usage(final=True)}
    if body.prompt_logprobs is not None and outputs:
        response["prompt_logprobs"] = vllm_prompt_logprobs(outputs[0].prompt_token_ids, outputs[0].prompt_logprobs,
                                                           texts, body.prompt_logprobs)
    return JSONResponse(response)


def _choice(index: int, output: RequestOutput, plan: ToolPlan | None, top: int | None, texts,
            return_ids: bool) -> dict:
    message: dict = {"role": "assistant", "content": output.text}
    finish_reason = output.finish_reason
    if plan is not None:
        content, calls = parse_whole(plan.parser(), output.text)
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
        finish_reason = _finish_reason(finish_reason, bool(calls), plan)
    choice = {"index": index, "message": message,
              "logprobs": format_logprobs(output.logprobs, texts, top) if top is not None else None,
              "finish_reason": finish_reason, "stop_reason": output.stop_reason}
    if return_ids:
        choice["token_ids"] = output.token_ids
    return choice
