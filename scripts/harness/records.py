"""What one benchmark run measured: per-request timestamps, token ids, engine counters.

All times are ``time.perf_counter()`` seconds in this process, the clock
asyncbatch's metrics and transformers' continuous-batching timestamps use.

Invariants of a ``RequestRecord``:
- ``arrival <= first_token <= finish`` whenever the request produced a token;
- ``chunk_times`` (when recorded) are non-decreasing, one per delivery to the
  caller; a delivery may carry several tokens, so ``len(chunk_times) <= output_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise


@dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    output_len: int  # tokens delivered to the caller
    arrival: float  # submitted to the system
    first_token: float | None  # first output token available to the caller
    finish: float | None  # last output token available to the caller
    chunk_times: list[float] | None = None  # per-delivery times; None where the system records none
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (latency - TTFT) / (output tokens - 1)."""
        if self.output_len < 2 or self.finish is None or self.first_token is None:
            return None
        return (self.finish - self.first_token) / (self.output_len - 1)

    def itls(self) -> list[float]:
        """Gaps between consecutive deliveries (vLLM's inter-token latency)."""
        t = self.chunk_times
        if not t or len(t) < 2:
            return []
        return [b - a for a, b in pairwise(t)]


@dataclass(slots=True)
class RunResult:
    """One system on one request set, once.

    ``start``/``end`` bracket the timed part: from the first submission to the
    last output. ``computed_tokens`` counts every token position the system ran
    through the model, padding and tokens past a request's own limit included
    (padded static batching wastes some); output throughput counts only
    ``RequestRecord.output_len``.
    """

    system: str
    requests: list[RequestRecord]
    start: float
    end: float
    computed_tokens: int | None = None
    engine_stats: dict | None = None
    memory: dict = field(default_factory=dict)
    request_rate: float | None = None  # None: offline, everything submitted at once
    cpu_s: float | None = None  # this process's CPU time (all threads) inside the timed window
    host: dict = field(default_factory=dict)  # contention by other processes (``host_load.HostLoad``)

    @property
    def duration(self) -> float:
        return self.end - self.start
