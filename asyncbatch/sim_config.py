"""Parameters of the simulated device (``device="sim"``)."""

from __future__ import annotations

from dataclasses import dataclass

OUTPUT_LENGTH_DISTRIBUTIONS = ("uniform", "geometric", "fixed")


@dataclass(slots=True)
class SimConfig:
    """Cost model and output-length model of the simulated device.

    One step costs ``step_fixed_ms + per_token_us * scheduled_tokens +
    per_context_token_ns * context_tokens`` of wall time, spent sleeping so the
    GIL is free, as a real device would leave it. Pseudo-tokens are a hash of
    (seed, request key, position, previous token), so they are deterministic and
    depend on the token fed back from the previous step; the end-of-sequence
    token is emitted once a request reaches its drawn output length.

    Defaults are in the range measured for SmolLM2-135M decode on one H200
    (a few ms per step at a few hundred requests); every figure produced on this
    device is labelled simulated.
    """

    step_fixed_ms: float = 2.0
    per_token_us: float = 4.0
    per_context_token_ns: float = 5.0
    output_len_distribution: str = "uniform"
    output_len_min: int = 16
    output_len_max: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("step_fixed_ms", "per_token_us", "per_context_token_ns"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"SimConfig.{name} must be a number >= 0, got {value!r}")
        if self.output_len_distribution not in OUTPUT_LENGTH_DISTRIBUTIONS:
            raise ValueError(
                f"SimConfig.output_len_distribution must be one of {OUTPUT_LENGTH_DISTRIBUTIONS}, "
                f"got {self.output_len_distribution!r}"
            )
        if not 1 <= self.output_len_min <= self.output_len_max:
            raise ValueError(
                f"SimConfig needs 1 <= output_len_min <= output_len_max, got "
                f"{self.output_len_min}, {self.output_len_max}"
            )

    def step_seconds(self, scheduled_tokens: int, context_tokens: int) -> float:
        return (
            self.step_fixed_ms * 1e-3
            + self.per_token_us * 1e-6 * scheduled_tokens
            + self.per_context_token_ns * 1e-9 * context_tokens
        )
