"""``SpeculativeConfig``: which proposer drafts tokens, how many, and when speculation is switched off.

vLLM's shape and names (``speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}``, or ``{"method": "draft_model", "model": PATH,
"num_speculative_tokens": 4}``), validated once when the engine is configured: a bad value is a
``ValueError`` naming the field and its allowed range. What needs the model's files (the draft's vocabulary
against the target's) is checked when the engine resolves its model (``engine.builder.resolve_model``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SPECULATIVE_METHODS = ("ngram", "draft_model")
# ``model`` values that mean the n-gram proposer when ``method`` is not given (vLLM's spelling).
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
# A verify step writes 1 + k positions per row; with k < block_size a row crosses at most one block boundary
# per step, which the planner's one-block-a-step growth relies on.
MAX_SPECULATIVE_TOKENS = 8


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculation: each running row drafts up to ``num_speculative_tokens`` tokens and one forward of the
    target verifies them.

    ``method``: ``"ngram"`` (prompt lookup: n-gram matching against the row's own prompt and outputs,
    ``ngram.ngram_propose``) or ``"draft_model"`` (the greedy tokens of a smaller model, ``model``, that
    shares the target's vocabulary: ``draft_model.DraftModel``). None infers it as vLLM does: ``"draft_model"``
    when ``model`` names a model, ``"ngram"`` when ``model`` is ``"ngram"``; unlike vLLM, neither given is
    ``"ngram"`` (the engine's default proposer, which needs no model). Resolved in ``__post_init__``: after it
    ``method`` is never None.
    ``model``: the draft model, in any form ``LLM(model=...)`` takes (a Hugging Face folder, a ``.gguf`` file,
    the default model's alias); required by ``"draft_model"``, refused with ``"ngram"``.

    ``disable_by_batch_size``: a step whose decode rows number more than this verifies no drafts (vLLM's
    field): a large batch is compute-bound, where checking drafts costs what they save. None: never.
    ``min_acceptance``: a row whose recent acceptance rate (drafted tokens accepted, an exponential average
    over its verify steps) is below this stops drafting, and tries again every ``retry_every`` steps.
    ``prefill_first``: a verify step's drafts take only the token budget that prefill leaves: the next chunks
    of running requests still prefilling and the prompts of the waiting requests that a free token row (and
    the free KV blocks) would admit come first, so a burst of arrivals is admitted as fast as without
    speculation (time to first token) and its steps stay prefill steps. False: drafts first (vLLM's order),
    prefill gets what they leave.
    """

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 8
    min_acceptance: float = 0.1
    retry_every: int = 16
    prefill_first: bool = True

    def __post_init__(self) -> None:
        self._resolve_method()
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 64)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        if isinstance(self.min_acceptance, bool) or not isinstance(self.min_acceptance, (int, float)) \
                or not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance must be in [0, 1], got {self.min_acceptance!r}")
        _int_in("retry_every", self.retry_every, 1, 1 << 20)
        if not isinstance(self.prefill_first, bool):  # a ValueError naming the field, as every bad config value
            raise ValueError(f"speculative_config.prefill_first must be True or False, "  # noqa: TRY004
                             f"got {self.prefill_first!r}")

    def _resolve_method(self) -> None:
        """``method`` from ``model`` where it is None (vLLM's inference), then ``model`` checked against it."""
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"speculative_config.model must be a non-empty path or model name, got {self.model!r}")
        if self.method is None:
            if self.model in NGRAM_MODEL_NAMES:
                self.method, self.model = "ngram", None
            else:
                self.method = "ngram" if self.model is None else "draft_model"
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config.model is required with method='draft_model': a model folder, "
                             ".gguf file or model alias that shares the target's vocabulary")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config.model must not be given with method='ngram' (got "
                             f"{self.model!r}); use method='draft_model' to draft with a model")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A ``SpeculativeConfig`` from itself, a dict of its fields (unknown keys refused), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be an int in [{low}, {high}], got {value!r}")
