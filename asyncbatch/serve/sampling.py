"""From an OpenAI request body to the engine's ``SamplingParams``, one per choice.

OpenAI's defaults apply where a field is absent (``temperature`` 1, ``top_p``
1, completions ``max_tokens`` 16, chat ``max_tokens`` the rest of the context).
With ``n`` > 1 and a ``seed``, choice ``i`` gets ``seed + i`` so the choices
differ yet the response is reproducible. A sampling field left out takes the
model's generation config default where it has one (vLLM's
``--generation-config auto``), else OpenAI's.

Output constraints come from exactly one field: ``response_format``
(``text``, ``json_object``, ``json_schema``), vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, its
``structured_outputs`` object, or the tools' schema (``tool_choice``
``required`` or a named function). Every refusal is a 400 whose ``param`` is
the request's field and whose message names the exact place.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from asyncbatch.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, child_seed
from asyncbatch.serve.engine_protocol import AsyncEngineClient
from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from asyncbatch.structured_outputs import KINDS, StructuredOutputsParams

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
_FIELD = re.compile(r"^SamplingParams\.([A-Za-z_]+)")


def check_supported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse, naming the field, what the engine cannot do or what contradicts itself, rather than ignore it."""
    def refuse(param: str, why: str) -> None:
        raise OpenAIError(400, f"{param} is not supported by this server: {why}", param=param)

    if not 1 <= body.n <= MAX_N:
        raise OpenAIError(400, f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:
        refuse("prompt_logprobs", "the prompt's logprobs come with the finished output; use stream=false")
    if isinstance(body, CompletionRequest):
        if body.best_of is not None and body.best_of != body.n:
            refuse("best_of", "only best_of == n (plain sampling) is served")
        if body.suffix:
            refuse("suffix", "insertion (fill-in-the-middle) is not served")
    else:
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                                  param="top_logprobs")


def chat_max_tokens(body: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` (the current name) wins over the deprecated ``max_tokens``."""
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """``SamplingParams.logprobs`` for a chat request: ``top_logprobs`` alternatives if ``logprobs`` is on."""
    return (body.top_logprobs or 0) if body.logprobs else None


def completion_prompt_logprobs(body: CompletionRequest) -> int | None:
    """``echo`` with ``logprobs`` needs the prompt's logprobs too (as many alternatives as the output's)."""
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(wanted) if wanted else None


# -- output constraints ----------------------------------------------------------------------------------
def structured_outputs(body: SamplingFields, tools_schema: dict[str, Any] | None = None
                       ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from (errors at submission are named after it).

    ``tools_schema`` is the constraint ``tool_choice`` ``required`` / a named function imposes."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if tools_schema is not None:
        sources.append(("tools", {"json": tools_schema}))
    if body.response_format is not None:
        constraint = _response_format(body.response_format)
        if constraint is not None:
            sources.append(("response_format", constraint))
    for name, kind in _GUIDED:
        value = getattr(body, name)
        if value is not None:
            sources.append((name, {kind: value}))
    if body.structured_outputs is not None:
        unknown = sorted(set(body.structured_outputs) - set(KINDS))
        if unknown:
            raise OpenAIError(400, f"structured_outputs takes {', '.join(KINDS)}; unknown: {', '.join(unknown)}",
                              param="structured_outputs")
        sources.append(("structured_outputs", {k: v for k, v in body.structured_outputs.items()
                                               if v is not None and v is not False}))
    if not sources:
        return None, None
    if len(sources) > 1:
        first, second = sources[0][0], sources[1][0]
        first = "tool_choice (required or a named function)" if first == "tools" else first
        raise OpenAIError(400, f"{second} and {first} both constrain the output; give one of them",
                          param=sources[1][0])
    source, kwargs = sources[0]
    try:
        return StructuredOutputsParams(**kwargs), source
    except (ValueError, TypeError) as exc:
        raise OpenAIError(400, f"{source}: {exc}", param=source) from exc


def _response_format(response_format: dict[str, Any]) -> dict[str, Any] | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError(400, "response_format.json_schema must be an object {'name', 'schema', 'strict'}",
                              param="response_format")
        schema = spec.get("schema")
        if not isinstance(schema, (dict, str)):
            raise OpenAIError(400, "response_format.json_schema.schema must be a JSON schema (an object), got "
                              f"{type(schema).__name__}", param="response_format")
        return {"json": schema}
    raise OpenAIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      param="response_format")


@contextlib.contextmanager
def naming_constraint_errors(source: str | None) -> Iterator[None]:
    """Submission refuses a schema/regex/grammar that does not compile (``structured_outputs.<kind> ...``):
    name the request's field it came from instead. A server without a grammar library cannot constrain any
    output: a 400 naming the field and what to install, not an internal error."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        if source is not None and str(exc).startswith("structured_outputs"):
            raise OpenAIError(400, f"{source}: {exc}", param=source) from exc
        raise
    except ImportError as exc:
        field = source or "structured_outputs"
        raise OpenAIError(400, f"{field}: this server cannot constrain outputs: {exc}", param=field) from exc


async def compile_constraint(engine: AsyncEngineClient, params: SamplingParams,
                             source: str | None) -> None:
    """Compile the request's constraint on a worker thread before submission, which then finds it in the
    compiler's cache: the first compile builds the tokenizer's tables (~2 s at a 49k vocabulary) and a large
    schema takes a while, time the event loop would otherwise take from every stream."""
    if params.structured_outputs is not None:
        with naming_constraint_errors(source):
            await asyncio.to_thread(engine.processor.check_structured_outputs, params)


# -- SamplingParams --------------------------------------------------------------------------------------
def sampling_params(body: SamplingFields, max_tokens: int, *, defaults: Mapping[str, Any] | None = None,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> list[SamplingParams]:
    """One ``SamplingParams`` per choice (``n``); a value out of range is a 400 naming the field. A sampling field
    the body leaves out takes the engine's default (``defaults``: the model's generation config, vLLM's rule), else
    OpenAI's; the generation config's ``max_tokens`` caps ``max_tokens`` as in vLLM."""
    defaults = defaults or {}
    if "max_tokens" in defaults:
        max_tokens = min(max_tokens, defaults["max_tokens"])
    params = []
    for i in range(body.n):
        seed = child_seed(body.seed, i)
        try:
            params.append(SamplingParams(
                max_tokens=max_tokens,
                temperature=defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
                top_p=defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
                top_k=defaults.get("top_k", -1) if body.top_k is None else body.top_k,
                min_p=defaults.get("min_p", 0.0) if body.min_p is None else body.min_p,
                seed=seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
                frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
                repetition_penalty=(defaults.get("repetition_penalty", 1.0) if body.repetition_penalty is None
                                    else body.repetition_penalty),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=body.logit_bias,
                min_tokens=body.min_tokens,
                structured_outputs=structured,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                allowed_token_ids=body.allowed_token_ids,
                bad_words=body.bad_words,
                cache_salt=body.cache_salt,
                priority=body.priority,
            ))
        except (ValueError, TypeError) as exc:
            field = _FIELD.match(str(exc))
            raise OpenAIError(400, str(exc), param=field.group(1) if field else None) from exc
    return params
