"""Per-request sampling parameters, validated when the request is submitted.

Every check raises ``ValueError`` (or ``TypeError`` for a wrong type) whose message
names the field and the allowed range, so a bad request is refused before it can
disturb the requests already running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

# Largest seed the on-device counter hash accepts (it mixes seeds as int64).
MAX_SEED = 2**63 - 1


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
    return int(value)


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

    ``temperature == 0`` means greedy. ``top_k`` of -1 or 0 disables top-k.
    ``seed`` makes the request's tokens reproducible regardless of what else is
    in the batch; without it the engine derives one from its own seed and the
    request id.
    """

    max_tokens: int = 16
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.max_tokens = _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be a bool, got {type(getattr(self, name)).__name__}")
        self._stop = self._normalize_stop(self.stop)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise TypeError("SamplingParams.stop_token_ids must be a list of ints")
            self.stop_token_ids = [_check_int("stop_token_ids[]", t) for t in self.stop_token_ids]
            if any(t < 0 for t in self.stop_token_ids):
                raise ValueError("SamplingParams.stop_token_ids must be >= 0")

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
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
