"""``SpeculativeConfig``: which proposer drafts tokens, how many, and when speculation is switched off.

vLLM's shape and names (``speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}``), validated once when the engine is configured: a bad
value is a ``ValueError`` naming the field and its allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SPECULATIVE_METHODS = ("ngram",)
# A verify step writes 1 + k positions per row; with k < block_size a row crosses at most one block boundary
# per step, which the planner's one-block-a-step growth relies on.
MAX_SPECULATIVE_TOKENS = 8


@dataclass(slots=True)
class SpeculativeConfig:
    """Prompt-lookup speculation: each running row drafts up to ``num_speculative_tokens`` tokens by n-gram
    matching against its own prompt and outputs (``ngram.ngram_propose``), and one forward verifies them.

    ``disable_by_batch_size``: a step whose decode rows number more than this verifies no drafts (vLLM's
    field): a large batch is compute-bound, where checking drafts costs what they save. None: never.
    ``min_acceptance``: a row whose recent acceptance rate (drafted tokens accepted, an exponential average
    over its verify steps) is below this stops drafting, and tries again every ``retry_every`` steps.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 8
    min_acceptance: float = 0.1
    retry_every: int = 16

    def __post_init__(self) -> None:
        if self.method == "draft_model":
            raise ValueError("speculative_config.method='draft_model' is not supported yet; supported: "
                             f"{list(SPECULATIVE_METHODS)}")
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
