"""Numbers from one load point of the serving benchmark: throughput, goodput under an SLO, latencies.

Definitions (vLLM's ``benchmark_serving``; per-request quantities in ``serving_client``):

- duration: from the start of the replay to the end of the last request;
- request / output-token / total-token throughput: successful requests, their output tokens, their
  prompt + output tokens, each over the duration;
- goodput: successful requests that met every SLO given (TTFT <= ``slo.ttft_ms``, TPOT <=
  ``slo.tpot_ms``) over the duration; a one-token output has no TPOT and meets a TPOT SLO by
  default, a failed request meets none; ``slo_attainment`` is their share of *all* requests;
- TTFT, TPOT, E2E: mean and P50/P90/P99 over successful requests; ITL: over the gaps between
  deliveries of every successful request, pooled (``metrics.distribution``, in ms).

Failed requests are counted (with their most frequent reasons) and excluded from the latency figures
and the throughputs, never silently dropped; ``outputs_not_max_tokens`` counts successful requests
whose output length differs from ``max_tokens`` (EOS honoured, or a server that overshoots).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from asyncbatch.bench.metrics import distribution
from asyncbatch.bench.serving_client import LoadRun, RequestResult

TOP_ERRORS = 5


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objective per request; None: no bound on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0, got {value}")

    def met_by(self, result: RequestResult) -> bool:
        if not result.success:
            return False
        if self.ttft_ms is not None and (result.ttft is None or 1e3 * result.ttft > self.ttft_ms):
            return False
        tpot = result.tpot
        return self.tpot_ms is None or tpot is None or 1e3 * tpot <= self.tpot_ms

    def as_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}


def failure_reasons(results: list[RequestResult]) -> list[dict]:
    """The most frequent error messages of the failed requests, with their counts."""
    counts = Counter(r.error for r in results if not r.success)
    return [{"error": error, "count": n} for error, n in counts.most_common(TOP_ERRORS)]


def summarize(run: LoadRun, slo: SLO) -> dict:
    """Every figure the report gives for one system at one load point."""
    ok = [r for r in run.results if r.success]
    duration = max(run.duration, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    known_prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    prompt_tokens = sum(known_prompts) if len(known_prompts) == len(ok) else None
    good = sum(slo.met_by(r) for r in run.results)
    return {
        "num_requests": len(run.results),
        "completed": len(ok),
        "failed": len(run.results) - len(ok),
        "failure_reasons": failure_reasons(run.results),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.max_tokens for r in ok),
        "outputs_not_max_tokens": sum(r.output_tokens != r.max_tokens for r in ok),
        "output_tokens_from_usage": sum(r.tokens_from_usage for r in ok),
        "streams_with_done": sum(r.saw_done for r in ok),
        "completed_without_text": sum(r.text_chars == 0 for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": None if prompt_tokens is None else (prompt_tokens + output_tokens) / duration,
        "goodput": good / duration,
        "slo_attainment": good / len(run.results) if run.results else None,
        "ttft_ms": distribution(r.ttft for r in ok),
        "tpot_ms": distribution(r.tpot for r in ok),
        "itl_ms": distribution(g for r in ok for g in r.itls()),
        "e2e_ms": distribution(r.e2e for r in ok),
        "client_cpu_s": run.client_cpu_s,
    }
