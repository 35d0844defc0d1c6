"""The offline results JSON's schema (``bench_throughput.py``, ``bench_latency.py``), checked by the
package's dependency-free validator (``asyncbatch.bench.schema``)."""

from __future__ import annotations

from asyncbatch.bench import schema
from asyncbatch.bench.schema import DISTRIBUTION, document_schema

SCHEMA_ID = "asyncbatch-bench/1"

_NUM = {"type": ["number", "null"]}
_SPREAD = {"type": ["object", "null"], "required": ["median", "min", "max", "rel_spread", "n"],
           "properties": {"median": {"type": "number"}, "n": {"type": "integer", "minimum": 1}}}
_RUN = {
    "type": "object",
    "required": ["num_requests", "prompt_tokens", "output_tokens", "duration_s", "request_throughput",
                 "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
                 "engine", "memory", "peak_memory_mib"],
    "properties": {
        "num_requests": {"type": "integer", "minimum": 1},
        "output_tokens": {"type": "integer", "minimum": 0},
        "duration_s": {"type": "number", "minimum": 0},
        "request_throughput": {"type": "number", "minimum": 0},
        "output_throughput": {"type": "number", "minimum": 0},
        "total_token_throughput": {"type": "number", "minimum": 0},
        "ttft_ms": DISTRIBUTION, "tpot_ms": DISTRIBUTION, "itl_ms": DISTRIBUTION, "e2e_ms": DISTRIBUTION,
        "engine": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        "memory": {"type": "object"},
        "peak_memory_mib": _NUM,
    },
}
_SUMMARY = {
    "type": "object",
    "required": ["duration_s", "request_throughput", "output_throughput", "total_token_throughput",
                 "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "engine", "peak_memory_mib"],
    "properties": {"output_throughput": _SPREAD, "request_throughput": _SPREAD,
                   "total_token_throughput": _SPREAD, "duration_s": _SPREAD,
                   "ttft_ms": {"type": ["object", "null"], "additionalProperties": _SPREAD},
                   "tpot_ms": {"type": ["object", "null"], "additionalProperties": _SPREAD},
                   "engine": {"type": ["object", "null"], "additionalProperties": _SPREAD}},
}
_RATE = {"type": ["number", "string", "null"]}
_POINT = {
    "type": "object",
    "required": ["request_rate", "runs", "summary", "cdf"],
    "properties": {"request_rate": _RATE, "runs": {"type": "array", "items": _RUN}, "summary": _SUMMARY,
                   "cdf": {"type": "object", "additionalProperties": {"type": ["array", "null"],
                                                                      "items": {"type": "number"}}}},
}
RESULTS_SCHEMA: dict = document_schema(SCHEMA_ID, ["throughput", "latency"], {
    "settings": {"type": "object", "required": ["device", "dtype", "temperature", "ignore_eos", "repeats"]},
    "request_rates": {"type": "array", "items": _RATE},
    "systems": {"type": "array", "items": {
        "type": "object", "required": ["name", "description", "config", "load_mib", "points"],
        "properties": {"name": {"type": "string"}, "points": {"type": "array", "items": _POINT}}}},
    "correctness": {"type": ["object", "null"]},
    "comparisons": {"type": "array", "items": {
        "type": "object", "required": ["request_rate", "numerator", "denominator", "output_throughput_ratio"]}},
    "plots": {"type": "array", "items": {"type": "string"}},
})


def validation_errors(doc: object, schema_doc: dict = RESULTS_SCHEMA, path: str = "$") -> list[str]:
    """Every place where ``doc`` breaks the results schema (or ``schema_doc``); empty when valid."""
    return schema.validation_errors(doc, schema_doc, path)


def validate(doc: object) -> None:
    """Raise ``ValueError`` listing the first problems if ``doc`` is not a valid results document."""
    schema.validate(doc, RESULTS_SCHEMA, "benchmark results")
