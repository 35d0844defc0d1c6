"""Checks a prompt at submission, before it can reach the scheduler (``input_processor`` runs them, once).

Every refusal is a ``ValueError`` or ``TypeError`` that names the field and the
allowed range; nothing is queued, so other requests are untouched.
"""

from __future__ import annotations

from numbers import Integral
from typing import TYPE_CHECKING

from asyncbatch.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: transformers is imported by the tokenizer's owner
    from transformers import PreTrainedTokenizerBase


def prompt_token_ids(prompt: object, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                     add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS, unless ``add_special_tokens``
    is False) or a list of token ids, validated against the vocabulary."""
    if prompt is None:
        raise TypeError("prompt must be a string or a list of token ids, got None")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("prompt is text but the engine has no tokenizer (skip_tokenizer_init=True): "
                             "pass a list of token ids")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise ValueError("prompt encodes to zero tokens")
        return list(ids)
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("prompt (token ids) must not be empty")
        if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
            raise TypeError("prompt token ids must be a flat list of ints (got a nested list or non-int entries)")
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size - 1}], got {bad[:5]}")
        return ids
    raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def check_needs_no_tokenizer(params: SamplingParams) -> None:
    """Without a tokenizer there is no text, so text-matching options cannot work: refuse them."""
    if params.stop_strings:
        raise ValueError("SamplingParams.stop needs text, but the engine has no tokenizer "
                         "(skip_tokenizer_init=True); use stop_token_ids")
    if params.structured_outputs is not None:
        raise ValueError("SamplingParams.structured_outputs needs the tokenizer's vocabulary, but the engine has "
                         "none (skip_tokenizer_init=True)")
    if params.bad_words:
        raise ValueError("SamplingParams.bad_words needs the tokenizer to find the words' tokens, but the engine has "
                         "none (skip_tokenizer_init=True); use allowed_token_ids or logit_bias")


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids the parameters name (``stop_token_ids``, ``logit_bias`` keys, ``allowed_token_ids``) must be in the
    vocabulary."""
    for name, ids in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.{name} token ids must be in [0, {vocab_size - 1}], got {bad[:5]}")


def check_fits(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, usable_tokens: int) -> None:
    """A request must fit the model's context and, alone, the whole KV cache."""
    total = num_prompt_tokens + params.max_tokens
    if num_prompt_tokens >= max_model_len:  # no max_tokens could fit: the prompt is what must change
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) leaves no room for an output in max_model_len {max_model_len}: "
            f"the prompt must be at most {max_model_len - 1} tokens (truncate_prompt_tokens keeps its end)")
    if total > max_model_len:
        raise ValueError(
            f"max_tokens ({params.max_tokens}) + prompt ({num_prompt_tokens} tokens) = {total} exceeds "
            f"max_model_len {max_model_len}; max_tokens must be <= {max_model_len - num_prompt_tokens}")
    if total > usable_tokens:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) needs {total} tokens of KV "
            f"cache but the cache holds {usable_tokens}; it could never run: lower max_tokens or enlarge the cache")
