"""The door every request goes through: a prompt (text, token ids, or a chat) in, a ``ProcessedRequest`` out.

    prompt ─► prompt_ids (tokenize; empty / type / vocabulary checks) ─┐   once per prompt
    chat   ─► chat_prompt_ids (the chat template) ─► prompt_ids ──────┤
                                                                        ▼
    params ─────────────────────────────────────────────────► request (params type, tokenizer needs,
                                                                   context and KV-cache fit) once per request
                                                                        ▼
                                                               ProcessedRequest ─► EngineClient.submit

Every front door (``LLM``, ``AsyncLLM``, the HTTP routes, the cluster's ingress) validates here and nowhere
else: ``EngineClient.submit`` and a Ray replica take a ``ProcessedRequest`` as it is. A refusal is a
``ValueError``/``TypeError`` naming the field and the allowed range, raised before anything is queued, so
other requests are untouched (DESIGN invariant 6). Should the engine core still be unable to place a request
(one built past this door), that request alone ends with ``finish_reason="error"``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncbatch.frontend.prompt_validation import (
    check_fits,
    check_needs_no_tokenizer,
    check_token_ids,
    prompt_token_ids,
)
from asyncbatch.sampling.token_constraints import bad_words_token_ids
from asyncbatch.sampling_params import SamplingParams, child_seed

if TYPE_CHECKING:  # annotations only: transformers is imported by the tokenizer's owner
    from transformers import PreTrainedTokenizerBase

# Text, token ids, or one of vLLM's prompt dicts (``unpack_prompt``).
Prompt = str | list[int] | Mapping[str, object]
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
logger = logging.getLogger(__name__)


def unpack_prompt(prompt: object, params: SamplingParams | None) -> tuple[object, SamplingParams | None]:
    """vLLM's prompt dicts as a plain prompt and the params that carry their ``cache_salt``: ``TextPrompt``
    (``{"prompt": text}``) and ``TokensPrompt`` (``{"prompt_token_ids": ids}``), each with an optional
    ``cache_salt``. Other prompts come back as they are; params with the dict's salt are a copy
    (``_params_with``)."""
    if not isinstance(prompt, Mapping):
        return prompt, params
    unknown = sorted(str(key) for key in prompt if key not in PROMPT_DICT_KEYS)
    if unknown:
        raise ValueError(f"prompt dict keys must be among {list(PROMPT_DICT_KEYS)}, got {unknown} (the engine runs "
                         "text models: no multi-modal inputs)")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    if "prompt" in prompt:
        inner = prompt["prompt"]
        if not isinstance(inner, str):
            raise TypeError(f"prompt dict 'prompt' must be a string, got {type(inner).__name__}")
    else:
        inner = prompt["prompt_token_ids"]
        if not isinstance(inner, (list, tuple)):
            raise TypeError(f"prompt dict 'prompt_token_ids' must be a list of ints, got {type(inner).__name__}")
    salt = prompt.get("cache_salt")
    if salt is None:
        return inner, params
    return inner, _params_with(params, "cache_salt", salt, "the prompt dict")


def with_priority(params: SamplingParams | None, priority: int) -> SamplingParams:
    """``params`` copied with ``priority`` (``LLM.generate``'s per-prompt argument, vLLM's)."""
    return _params_with(params, "priority", priority, "generate(priority=...)")


def _params_with(params: SamplingParams | None, name: str, value: object, source: str) -> SamplingParams:
    """``params`` (None: the defaults) copied with field ``name`` set to ``value`` from ``source`` (the caller's
    ``SamplingParams`` is never changed: one may serve many prompts); a different value already set there (not the
    field's default) is refused. ``SamplingParams`` checks the value."""
    params = SamplingParams() if params is None else params
    current = getattr(params, name)
    if current not in (SamplingParams.__dataclass_fields__[name].default, value):
        raise ValueError(f"{name} is given twice, {value!r} in {source} and {current!r} in SamplingParams: "
                         "give it once")
    return dataclasses.replace(params, **{name: value})


class ChatTemplateError(ValueError):
    """The chat template raised on a conversation (a message without a key it reads, its own
    ``raise_exception``): a user's error, named as one."""


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A validated request: what ``EngineClient.submit`` takes as it is. Built by ``InputProcessor.request``;
    whoever builds one otherwise vouches for it (a replica, for the ingress's validated request)."""

    prompt: str | None  # the user's text, when the prompt was text (names it in the output)
    prompt_token_ids: list[int]
    params: SamplingParams

    def completions(self) -> list[ProcessedRequest]:
        """The ``params.n`` requests that sample this one's completions, each with ``n == 1`` (vLLM's parallel
        sampling): completion ``i`` seeded ``seed + i`` where the params have a seed, else seeded as any request
        (the engine's seed and its own number), so they differ. ``[self]`` where ``n == 1``. The params are copied,
        not checked again: ``InputProcessor.request`` checked them once for all."""
        if self.params.n == 1:
            return [self]
        out = []
        for index in range(self.params.n):
            params = copy.copy(self.params)
            params.n, params.seed = 1, child_seed(self.params.seed, index)
            out.append(ProcessedRequest(self.prompt, self.prompt_token_ids, params))
        return out


class InputProcessor:
    """Tokenizes and validates against one engine's limits: its vocabulary, ``max_model_len`` and KV cache.

    Stateless past construction and thread-safe (the tokenizer is only read), so the asyncio API may
    tokenize on a worker thread. The grammar compiler that validates structured outputs is built once, on
    the first such request or ahead of it (``warm_up_grammar``); a request arriving meanwhile waits for it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, max_model_len: int,
                 usable_tokens: int, eos_token_id: int | None = None, grammar_backend: str = "auto",
                 scheduling_policy: str = "fcfs", sampling_defaults: dict[str, object] | None = None) -> None:
        self.tokenizer = tokenizer
        # What a request without SamplingParams gets, and the server's unset fields (generation_defaults.py).
        self.sampling_defaults: dict[str, object] = dict(sampling_defaults or {})
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.usable_tokens = usable_tokens  # tokens the whole KV cache holds
        self.eos_token_id = eos_token_id
        self.grammar_backend = grammar_backend
        self.scheduling_policy = scheduling_policy
        self._grammar = None  # the GrammarCompiler that validates structured_outputs, built on first use
        self._grammar_lock = threading.Lock()
        self._warmup: threading.Thread | None = None

    def default_params(self) -> SamplingParams:
        """A new ``SamplingParams`` of this engine's defaults (vLLM's ``get_default_sampling_params``): the model's
        generation config where it sets sampling fields (``generation_defaults``), else ``SamplingParams()``."""
        return SamplingParams(**self.sampling_defaults)

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's grammar (cached) so a bad schema, regex or grammar is a ``ValueError`` naming
        the field at submission, never a failure inside the engine."""
        if params.structured_outputs is None:
            return
        self._grammar_compiler().validate(params.structured_outputs)

    def _grammar_compiler(self):
        with self._grammar_lock:
            if self._grammar is None:
                from asyncbatch.sampling.grammar import GrammarCompiler

                self._grammar = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_id,
                                                backend=self.grammar_backend)
            return self._grammar

    def warm_up_grammar(self) -> None:
        """Build the grammar compiler on a thread of its own now (``EngineConfig.structured_outputs_warmup``);
        nothing to build without a tokenizer. One that cannot be built (no grammar library installed) is only
        logged: structured requests then get the reason, as they would without the warm-up."""
        if self.tokenizer is None or self._warmup is not None:
            return
        self._warmup = threading.Thread(target=self._warm_grammar, name="asyncbatch-grammar-warmup", daemon=True)
        self._warmup.start()

    def _warm_grammar(self) -> None:
        try:
            self._grammar_compiler()
        except Exception as exc:  # noqa: BLE001 - the structured requests will report it
            logger.info("structured outputs: the frontend's grammar compiler was not built ahead (%s: %s)",
                        type(exc).__name__, exc)

    def close(self) -> None:
        """Wait for a warm-up in progress (well under a second), so a closed engine leaves no thread behind."""
        if self._warmup is not None:
            self._warmup.join()

    @property
    def usable_context(self) -> int:
        """The most tokens (prompt + output) one request can have: the context, bounded by the KV cache."""
        return min(self.max_model_len, self.usable_tokens)

    def prompt_ids(self, prompt: object, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (``add_special_tokens``: the tokenizer's BOS and the like, as vLLM's
        completions add by default) or a list of token ids, checked against the vocabulary."""
        return prompt_token_ids(prompt, self.tokenizer, self.vocab_size, add_special_tokens)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, add_special_tokens: bool = False,
                        **template_kwargs: object) -> list[int]:
        """The token ids of one conversation under the model's chat template (or ``chat_template=``); not yet
        checked: pass them through ``prompt_ids``. ``continue_final_message`` leaves the last message open (no
        end-of-turn after it), so the model continues it: an assistant message given as the answer's start
        (vLLM's field; it excludes ``add_generation_prompt``). ``add_special_tokens``: the tokenizer's own special
        tokens around the rendered text too (off, as in vLLM: templates write their BOS themselves)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, but the engine has none (skip_tokenizer_init=True)")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
            if "role" not in message:
                raise ValueError(f"messages[{i}] has no 'role': {dict(message)!r}"[:300])
        if getattr(self.tokenizer, "chat_template", None) is None and template_kwargs.get("chat_template") is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template= (--chat-template)")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second starts a new one")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **template_kwargs)
        except Exception as exc:  # jinja's UndefinedError, TemplateError, ...: the messages did not fit the template
            raise ChatTemplateError(f"messages: the chat template failed on these messages: {type(exc).__name__}: "
                                    f"{exc}") from exc
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def truncated(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last ``params.truncate_prompt_tokens`` ids (-1: the last ``max_model_len``); all of
        them without it, or when the prompt is no longer."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens must be -1 or in [1, max_model_len="
                             f"{self.max_model_len}], got {keep}")
        return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids

    def request(self, prompt_ids: list[int], params: SamplingParams | None,
                prompt: str | None = None) -> ProcessedRequest:
        """One request of ``prompt_ids`` (from ``prompt_ids``) under ``params`` (None: the defaults); a
        ``truncate_prompt_tokens`` that cuts the prompt makes ``prompt`` the kept tokens' text."""
        params = self.default_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        kept = self.truncated(prompt_ids, params)
        if len(kept) < len(prompt_ids):
            prompt_ids = kept
            prompt = self.tokenizer.decode(kept) if self.tokenizer is not None and prompt is not None else None
        if params.max_tokens is None:  # vLLM's "up to the context": this prompt's room, on a copy of the params
            params = dataclasses.replace(params, max_tokens=max(self.max_model_len - len(prompt_ids), 1))
        if self.tokenizer is None:
            check_needs_no_tokenizer(params)
        elif params.bad_words:  # the words' tokens travel on a copy: the caller's params may serve other engines
            params = copy.copy(params)
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size)
        if params.priority and self.scheduling_policy != "priority":
            raise ValueError(f"SamplingParams.priority must be 0 unless the engine's scheduling_policy is 'priority' "
                             f"(it is {self.scheduling_policy!r}), got {params.priority}")
        check_token_ids(params, self.vocab_size)
        self.check_structured_outputs(params)
        check_fits(len(prompt_ids), params, self.max_model_len, self.usable_tokens)
        return ProcessedRequest(prompt, prompt_ids, params)

    def process(self, prompt: object, params: SamplingParams | None) -> ProcessedRequest:
        """``prompt_ids`` then ``request``: one prompt (a prompt dict too: ``unpack_prompt``), one request."""
        prompt, params = unpack_prompt(prompt, self.default_params() if params is None else params)
        return self.request(self.prompt_ids(prompt), params, prompt if isinstance(prompt, str) else None)
