"""The OpenAI-compatible request bodies (pydantic), with vLLM's sampling extras.

Unknown fields are refused (``extra="forbid"``: a misspelt ``max_token`` must
not silently fall back to a default); wrong types and missing fields too. Both
are a 400 with the OpenAI error object naming the field (``openai_errors``).
OpenAI's bookkeeping fields (``user``, ``store``, ``metadata``,
``service_tier``, ``prompt_cache_key``, ``safety_identifier``) are accepted
and have no effect. An explicit ``null`` is taken wherever OpenAI's schema
allows one: as "unset" by the optional fields, and as the default by ``n``,
``stream`` and ``echo``. Values out of range are checked by ``sampling`` /
``SamplingParams`` / ``tool_calls`` and are 400 naming the field. OpenAI fields the engine cannot honour (``suffix``,
``best_of`` > n) are accepted by the schema and refused by
``sampling.check_supported`` with a 400 that names them, instead of being
ignored. Output constraints: ``response_format`` (OpenAI; vLLM takes it on
completions too) or one of vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` / ``structured_outputs``
(docs/serving-features.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _null_means_default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """OpenAI's "X or null" fields that have a default here: an explicit ``null`` (what clients that write out
    every unset field send) is the default, as vLLM's ``Optional`` fields take it."""
    return cls.model_fields[info.field_name].default if value is None else value


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    """Fields both endpoints share: OpenAI's sampling parameters plus vLLM's extras."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's bookkeeping fields, about the caller or OpenAI's own storage and billing: accepted, no effect here
    # (clients and frameworks send them; refusing them would break calls that work against OpenAI and vLLM).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled
    bad_words: list[str] | None = None  # words the output never contains (``token_constraints``)
    cache_salt: str | None = None  # prefix-cache blocks shared only with requests of the same salt
    priority: int = 0  # lower first under --scheduling-policy priority; must be 0 otherwise
    # vLLM's: the choice also carries its token ids (and the prompt's); on by default without a tokenizer.
    return_token_ids: bool | None = None
    prompt_logprobs: int | None = None
    # Output constraints: OpenAI's response_format, or one of vLLM's guided_* / structured_outputs.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    _null_n_stream = field_validator("n", "stream", mode="before")(classmethod(_null_means_default))


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like around a text prompt
    best_of: int | None = None
    suffix: str | None = None

    _null_echo = field_validator("echo", mode="before")(classmethod(_null_means_default))


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; extra keys (``name``, ``tool_call_id``) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, not closed
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's own special tokens around the rendered template
    chat_template: str | None = None  # vLLM's: this request's Jinja template (``--trust-request-chat-template``)


class TokenizeRequest(_Body):
    """``POST /tokenize``: a prompt, or chat messages under the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as the chat route's (``--trust-request-chat-template``)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
