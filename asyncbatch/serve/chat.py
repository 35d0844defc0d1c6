"""``POST /v1/chat/completions``: messages under the chat template in, an assistant message out."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncbatch.outputs import StreamDelta
from asyncbatch.serve.generation import Generation, SSEResponse
from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.protocol import ChatCompletionRequest, ChatMessage
from asyncbatch.serve.sampling import chat_max_tokens, check_supported, sampling_params
from asyncbatch.serve.state import ServerState

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


def chat_prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    try:
        return state.engine.processor.chat_prompt_ids(template_messages(body.messages), body.add_generation_prompt,
                                   **(body.chat_template_kwargs or {}))
    except ValueError:
        raise
    except Exception as exc:
        raise OpenAIError(400, f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                          param="messages") from exc


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.check_model(body.model)
    check_supported(body)
    engine = state.engine
    ids = await engine.prompt_ids(chat_prompt_ids(state, body))  # checked against the model's vocabulary
    max_tokens = chat_max_tokens(body)
    if max_tokens is None:  # OpenAI: as many as the context allows
        room = engine.processor.usable_context - len(ids)
        if room < 1:
            raise OpenAIError(400, f"the messages take {len(ids)} tokens, which leaves no room in the "
                              f"context of {engine.max_model_len} tokens", param="messages")
        max_tokens = room
    params = sampling_params(body, max_tokens)
    state.admit(body.n)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    requests = engine.submit_ids([ids] * body.n, params, [f"{response_id}-{k}" for k in range(body.n)])
    return_ids = bool(body.return_token_ids)
    gen = Generation(state, response_id, model, requests, len(ids),
                     include_usage=bool(body.stream_options and body.stream_options.include_usage),
                     continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats))
    if body.stream:
        head = gen.chunk_head(_OBJECT)

        def chunk(index: int, delta: StreamDelta) -> dict:
            choice = {"index": index, "delta": {"content": delta.text} if delta.text else {}, "logprobs": None,
                      "finish_reason": delta.finish_reason}
            if delta.finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            if return_ids:
                choice["token_ids"] = delta.token_ids
            return {**head, "choices": [choice]}

        first = [{**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}]} for k in range(body.n)]
        return SSEResponse(gen.sse(_OBJECT, first, chunk))
    outputs = await gen.collect(request)
    choices = []
    for k, output in enumerate(outputs):
        choice = {"index": k, "message": {"role": "assistant", "content": output.text}, "logprobs": None,
                  "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}
        if return_ids:
            choice["token_ids"] = output.token_ids
        choices.append(choice)
    return JSONResponse({**gen.chunk_head("chat.completion"), "choices": choices, "usage": gen.usage()})
