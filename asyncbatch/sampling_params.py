"""Per-request sampling parameters, validated when the request is submitted.

Every check raises ``ValueError`` (or ``TypeError`` for a wrong type) whose message
names the field and the allowed range, so a bad request is refused before it can
disturb the requests already running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from asyncbatch.structured_outputs import StructuredOutputsParams

# Largest seed the on-device counter hash accepts (it mixes seeds as int64).
MAX_SEED = 2**63 - 1
# Most completions one request may ask for (``n``; the server's bound on OpenAI's ``n`` too).
MAX_N = 128
# Most alternatives per position ``logprobs`` / ``prompt_logprobs`` may ask for (vLLM's default bound).
MAX_LOGPROBS = 20
# ``logit_bias`` values are clamped to this range by OpenAI; here a value outside it is refused.
MAX_LOGIT_BIAS = 100.0
# ``priority`` is an integer in [-MAX_PRIORITY, MAX_PRIORITY].
MAX_PRIORITY = 2**31


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion ``index`` of a request seeded with ``seed`` (vLLM's parallel sampling: ``seed +
    index``), so its ``n`` completions differ and each is reproducible; a negative seed is left for the check
    that refuses it."""
    if seed is None or seed < 0:
        return seed
    return (seed + index) & MAX_SEED


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
    return int(value)


def _check_token_ids(name: str, value: object) -> list[int]:
    """A list of token ids (ints >= 0; the vocabulary bound is the input processor's check)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"SamplingParams.{name} must be a list of ints")
    ids = [_check_int(f"{name}[]", t) for t in value]
    if any(t < 0 for t in ids):
        raise ValueError(f"SamplingParams.{name} must be >= 0")
    return ids


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be finite, got {value}")
    return value


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Field names follow vLLM's ``SamplingParams``.

    ``n`` (1-128, vLLM's): completions of the prompt, each its own request with its own samples; ``LLM.generate``
    and ``LLM.chat`` return them as one ``RequestOutput``'s ``outputs`` (with a ``seed``, completion ``i`` is
    seeded ``seed + i``); ``LLM.stream`` and ``AsyncLLM.generate`` interleave their deltas (``StreamDelta.index``).
    ``max_tokens=None`` (vLLM's) lets each request fill the rest of the context (``max_model_len`` less its
    prompt). ``temperature == 0`` means greedy. ``top_k`` of -1 or 0 disables top-k.
    ``seed`` makes the request's tokens reproducible regardless of what else is
    in the batch; without it the engine derives one from its own seed and the
    request id.

    ``logprobs`` (0-20): return each sampled token's log-probability and the
    ``logprobs`` most likely alternatives at each position; ``prompt_logprobs``
    likewise for the prompt's tokens (from the second on). Both are computed from
    the model's raw distribution, before penalties, ``logit_bias``, grammar masks,
    temperature and top-k/top-p/min-p (vLLM's default ``raw_logprobs``).
    ``logit_bias`` adds a value in [-100, 100] to a token id's logit before
    sampling; ``min_tokens`` masks EOS and ``stop_token_ids`` until that many
    tokens were generated, and a stop string counts only where it ends in the text of a later token (vLLM's
    rule). ``include_stop_str_in_output`` keeps the stop string that ended the output in its
    text, and the text of the ``stop_token_ids`` token that ended it (vLLM's rule; EOS never shows in the text,
    other special tokens only without ``skip_special_tokens``). ``detokenize=False`` returns token ids only: ``text``
    stays empty and no detokenizer runs for the request (vLLM's field; stop
    strings need the text). ``structured_outputs`` constrains the output to a
    JSON schema, any JSON object, a regex, a choice or a grammar.
    ``truncate_prompt_tokens`` keeps only the prompt's last k tokens (left
    truncation; -1: the last ``max_model_len``), vLLM's field: the request's
    ``prompt_token_ids`` are the kept ones, and its ``prompt`` their text.
    ``allowed_token_ids`` (vLLM's): only these ids may be sampled. ``bad_words``
    (vLLM's): words and phrases the output never contains as whole tokens: the
    engine tokenizes each (as it stands, and after a space) and forbids a phrase's
    last token wherever the output so far ends with the rest of it. Both are
    token masks, filled under overlap like a grammar's (``token_constraints``).
    ``cache_salt`` (vLLM's request field): the request's prefix-cache blocks are
    shared only with requests of the same salt (one tenant's prompts cannot be
    probed through another's cache hits); give each tenant a long random secret.
    ``priority`` (vLLM's request priority; an engine with
    ``scheduling_policy="priority"``, else it must be 0): waiting requests are
    admitted lowest value first, in arrival order among equals, and a request
    short of KV blocks preempts the running request of the largest value (the
    latest arrival among equals) before any of its betters.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context (vLLM's), resolved per request by the input processor
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    priority: int = 0
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)
    # ``bad_words`` as token id phrases, set by the frontend (``InputProcessor``), which has the tokenizer.
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"SamplingParams.n must be in [1, {MAX_N}], got {self.n}")
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"SamplingParams.max_tokens must be >= 1 or None, got {self.max_tokens}")
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"SamplingParams.seed must be in [0, 2**63 - 1], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be a bool, got {type(getattr(self, name)).__name__}")
        self._stop = self._normalize_stop(self.stop)
        if self._stop and not self.detokenize:
            raise ValueError("SamplingParams.stop needs detokenize=True (stop strings are matched in the text)")
        if self.stop_token_ids is not None:
            self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"SamplingParams.{name} must be in [0, {MAX_LOGPROBS}], got {value}")
                setattr(self, name, value)
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError("SamplingParams.truncate_prompt_tokens must be -1 (max_model_len) or >= 1, got "
                                 f"{self.truncate_prompt_tokens}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("SamplingParams.allowed_token_ids must not be empty (None allows every token)")
        if self.bad_words is not None:
            if isinstance(self.bad_words, (str, bytes)) or not hasattr(self.bad_words, "__iter__"):
                raise TypeError("SamplingParams.bad_words must be a list of strings")
            self.bad_words = list(self.bad_words)
            for word in self.bad_words:
                if not isinstance(word, str):
                    raise TypeError(f"SamplingParams.bad_words must be a list of strings, got {type(word).__name__}")
                if not word.strip():
                    raise ValueError("SamplingParams.bad_words entries must not be empty or blank")
            self.bad_words = self.bad_words or None
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError("SamplingParams.cache_salt must be a non-empty string if given")
        self.priority = _check_int("priority", self.priority)
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"SamplingParams.priority must be in [-2**31, 2**31], got {self.priority}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError("SamplingParams.structured_outputs must be StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")

    @staticmethod
    def _normalize_logit_bias(bias: object) -> dict[int, float] | None:
        """Token id -> bias; OpenAI's string keys ("50256") are accepted. Ids are checked against the
        vocabulary at submission (``InputProcessor``), which knows it."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise TypeError("SamplingParams.logit_bias must be a dict of token id -> bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token = int(key) if isinstance(key, str) else _check_int("logit_bias key", key)
            except ValueError:
                raise ValueError(f"SamplingParams.logit_bias keys must be token ids, got {key!r}") from None
            if token < 0:
                raise ValueError(f"SamplingParams.logit_bias keys must be token ids >= 0, got {token}")
            value = _check_float(f"logit_bias[{token}]", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"SamplingParams.logit_bias[{token}] must be in [-100, 100], got {value}")
            out[token] = value
        return out or None

    @staticmethod
    def _normalize_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError("SamplingParams.stop must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise ValueError("SamplingParams.stop must not contain an empty string")
        return tuple(stop)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrains_tokens(self) -> bool:
        """Whether the output is masked token by token: a grammar, ``allowed_token_ids`` or ``bad_words``."""
        return self.structured_outputs is not None or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def token_ids_named(self) -> list[int]:
        """Every token id the parameters name (stop ids, bias keys, allowed ids): checked against the vocabulary."""
        return list(self.stop_token_ids or ()) + list(self.logit_bias or ()) + list(self.allowed_token_ids or ())

    @property
    def eos_ends(self) -> bool:
        """Whether an EOS token ends the request: unless ``ignore_eos``, and always under ``structured_outputs``,
        whose grammar allows EOS only once it is complete, and nothing after it."""
        return not self.ignore_eos or self.structured_outputs is not None

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
