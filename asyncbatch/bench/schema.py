"""The results JSONs' schemas (JSON Schema documents) and a dependency-free validator for them.

``RESULTS_SCHEMA``: ``bench_throughput.py`` and ``bench_latency.py``; ``SERVING_SCHEMA``: ``bench_serving.py``.

The validator implements the subset of JSON Schema the schema uses: ``type``
(one or a list), ``required``, ``properties``, ``additionalProperties`` (a
schema), ``items``, ``enum`` and ``minimum``. Scripts validate their document
before writing it; the smoke test validates what they wrote (and, where the
``jsonschema`` package is installed, checks the same document with it too).
"""

from __future__ import annotations

SCHEMA_ID = "asyncbatch-bench/1"

_NUM = {"type": ["number", "null"]}
_DIST = {"type": ["object", "null"], "required": ["mean", "p50", "p90", "p99"],
         "additionalProperties": {"type": "number"}}
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
        "ttft_ms": _DIST, "tpot_ms": _DIST, "itl_ms": _DIST, "e2e_ms": _DIST,
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
RESULTS_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": SCHEMA_ID,
    "type": "object",
    "required": ["schema", "kind", "created_utc", "command", "git_commit", "machine", "settings", "workload",
                 "request_rates", "systems", "correctness", "comparisons", "plots"],
    "properties": {
        "schema": {"enum": [SCHEMA_ID]},
        "kind": {"enum": ["throughput", "latency"]},
        "created_utc": {"type": "string"},
        "command": {"type": "string"},
        "git_commit": {"type": ["string", "null"]},
        "machine": {"type": "object", "required": ["cpu", "cores", "torch", "transformers", "device"]},
        "settings": {"type": "object", "required": ["device", "dtype", "temperature", "ignore_eos", "repeats"]},
        "workload": {"type": "object", "required": ["name", "num_requests", "prompt_tokens", "output_tokens"]},
        "request_rates": {"type": "array", "items": _RATE},
        "systems": {"type": "array", "items": {
            "type": "object", "required": ["name", "description", "config", "load_mib", "points"],
            "properties": {"name": {"type": "string"}, "points": {"type": "array", "items": _POINT}}}},
        "correctness": {"type": ["object", "null"]},
        "comparisons": {"type": "array", "items": {
            "type": "object", "required": ["request_rate", "numerator", "denominator", "output_throughput_ratio"]}},
        "plots": {"type": "array", "items": {"type": "string"}},
    },
}

SERVING_SCHEMA_ID = "asyncbatch-bench-serving/1"
_INT0 = {"type": "integer", "minimum": 0}
_SERVING_SUMMARY = {
    "type": "object",
    "required": ["num_requests", "completed", "failed", "failure_reasons", "duration_s", "prompt_tokens",
                 "output_tokens", "outputs_not_max_tokens", "request_throughput", "output_throughput",
                 "total_token_throughput", "goodput", "slo_attainment", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"],
    "properties": {
        "num_requests": _INT0, "completed": _INT0, "failed": _INT0, "output_tokens": _INT0,
        "outputs_not_max_tokens": _INT0,
        "failure_reasons": {"type": "array", "items": {"type": "object", "required": ["error", "count"]}},
        "duration_s": {"type": "number", "minimum": 0},
        "request_throughput": {"type": "number", "minimum": 0},
        "output_throughput": {"type": "number", "minimum": 0},
        "goodput": {"type": "number", "minimum": 0},
        "ttft_ms": _DIST, "tpot_ms": _DIST, "itl_ms": _DIST, "e2e_ms": _DIST,
    },
}
_SERVING_POINT = {
    "type": "object",
    "required": ["load", "summary", "server", "host", "requests"],
    "properties": {
        "load": {"type": "object", "required": ["request_rate", "max_concurrency", "label"]},
        "summary": _SERVING_SUMMARY,
        "server": {"type": "object", "required": ["available"]},
        "host": {"type": "object", "required": ["client_cpu_s", "server_cpu_s", "contention"]},
        "requests": {"type": "array", "items": {
            "type": "object", "required": ["index", "success", "error", "output_tokens", "ttft_ms", "e2e_ms"]}},
    },
}
SERVING_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": SERVING_SCHEMA_ID,
    "type": "object",
    "required": ["schema", "kind", "created_utc", "command", "git_commit", "machine", "settings", "workload",
                 "loads", "systems", "comparisons", "notes", "plots"],
    "properties": {
        "schema": {"enum": [SERVING_SCHEMA_ID]},
        "kind": {"enum": ["serving"]},
        "machine": {"type": "object", "required": ["cpu", "cores", "torch", "transformers", "device"]},
        "settings": {"type": "object", "required": ["device", "dtype", "temperature", "ignore_eos", "slo",
                                                    "prompt_format", "endpoint"]},
        "workload": {"type": "object", "required": ["name", "num_requests", "prompt_tokens", "output_tokens"]},
        "loads": {"type": "array", "items": {"type": "object", "required": ["request_rate", "label"]}},
        "systems": {"type": "array", "items": {
            "type": "object", "required": ["name", "description", "dialect", "base_url", "command",
                                           "served_model", "points"],
            "properties": {"name": {"type": "string"}, "points": {"type": "array", "items": _SERVING_POINT}}}},
        "comparisons": {"type": "array", "items": {
            "type": "object", "required": ["load", "numerator", "denominator", "output_throughput_ratio",
                                           "p99_ttft_ratio", "p99_tpot_ratio"]}},
        "notes": {"type": "array", "items": {"type": "string"}},
        "plots": {"type": "array", "items": {"type": "string"}},
    },
}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(value: object, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def validation_errors(doc: object, schema: dict = RESULTS_SCHEMA, path: str = "$") -> list[str]:
    """Every place where ``doc`` breaks ``schema``, as ``"$.a.b: message"``; empty when valid."""
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_is_type(doc, t) for t in names):
            return [f"{path}: expected {'/'.join(names)}, got {type(doc).__name__}"]
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{path}: {doc!r} not in {schema['enum']}")
    if "minimum" in schema and _is_type(doc, "number") and doc < schema["minimum"]:
        errors.append(f"{path}: {doc} < minimum {schema['minimum']}")
    if isinstance(doc, dict):
        errors += [f"{path}: missing {key!r}" for key in schema.get("required", []) if key not in doc]
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in doc.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                errors += validation_errors(value, sub, f"{path}.{key}")
    if isinstance(doc, list) and "items" in schema:
        for i, value in enumerate(doc):
            errors += validation_errors(value, schema["items"], f"{path}[{i}]")
    return errors


def validate(doc: object) -> None:
    """Raise ``ValueError`` listing the first problems if ``doc`` is not a valid results document."""
    errors = validation_errors(doc)
    if errors:
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        raise ValueError("invalid benchmark results: " + "; ".join(errors[:10]) + more)
