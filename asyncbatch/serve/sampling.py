"""From an OpenAI request body to the engine's ``SamplingParams``, one per choice.

OpenAI's defaults apply where a field is absent (``temperature`` 1, ``top_p``
1, completions ``max_tokens`` 16, chat ``max_tokens`` the rest of the context).
With ``n`` > 1 and a ``seed``, choice ``i`` gets ``seed + i`` so the choices
differ yet the response is reproducible.
"""

from __future__ import annotations

from asyncbatch.sampling_params import MAX_SEED, SamplingParams
from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_N = 128


def check_supported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse, naming the field, what the engine cannot do, rather than ignore it."""
    def refuse(param: str, why: str) -> None:
        raise OpenAIError(400, f"{param} is not supported by this server: {why}", param=param)

    if not 1 <= body.n <= MAX_N:
        raise OpenAIError(400, f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if body.logit_bias:
        refuse("logit_bias", "the on-device sampler has no per-token bias")
    if body.min_tokens:
        refuse("min_tokens", "EOS is never masked; use ignore_eos with max_tokens")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None:
            refuse("logprobs", "log-probabilities are not returned by the on-device sampler yet")
        if body.best_of is not None and body.best_of != body.n:
            refuse("best_of", "only best_of == n (plain sampling) is served")
        if body.suffix:
            refuse("suffix", "insertion (fill-in-the-middle) is not served")
    else:
        if body.logprobs or body.top_logprobs is not None:
            refuse("logprobs", "log-probabilities are not returned by the on-device sampler yet")
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            refuse("response_format", "only plain text output is served (no guided decoding)")
        if body.tools:
            refuse("tools", "tool calling is not served")
        if body.tool_choice not in (None, "none"):
            refuse("tool_choice", "tool calling is not served")


def chat_max_tokens(body: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` (the current name) wins over the deprecated ``max_tokens``."""
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def sampling_params(body: SamplingFields, max_tokens: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per choice (``n``); raises ``ValueError`` naming a field out of range."""
    params = []
    for i in range(body.n):
        seed = body.seed
        if seed is not None and body.n > 1:
            seed = (seed + i) & MAX_SEED if seed >= 0 else seed  # a negative seed is refused below
        params.append(SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
            frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        ))
    return params
