"""The serving results JSON's schema (a JSON Schema document) and a dependency-free validator.

``SERVING_SCHEMA``: ``python -m asyncbatch.bench`` and ``scripts/bench_serving.py``; the offline
harness's ``RESULTS_SCHEMA`` (``scripts/harness/results_schema.py``) reuses ``DISTRIBUTION``,
``document_schema`` and the validator.

The validator implements the subset of JSON Schema the schemas use: ``type``
(one or a list), ``required``, ``properties``, ``additionalProperties`` (a
schema), ``items``, ``enum`` and ``minimum``. Scripts validate their document
before writing it; the smoke tests validate what they wrote (and, where the
``jsonschema`` package is installed, check the same document with it too).
"""

from __future__ import annotations

# A latency distribution in milliseconds (``metrics.distribution``); null where it was not measured.
DISTRIBUTION = {"type": ["object", "null"], "required": ["mean", "p50", "p90", "p99"],
                "additionalProperties": {"type": "number"}}
INT0 = {"type": "integer", "minimum": 0}


def document_schema(schema_id: str, kinds: list[str], properties: dict) -> dict:
    """A results document's schema: what every document states (its schema, kind, time, command, commit,
    machine and workload), then its own ``properties``, all required."""
    common = {
        "schema": {"enum": [schema_id]},
        "kind": {"enum": kinds},
        "created_utc": {"type": "string"},
        "command": {"type": "string"},
        "git_commit": {"type": ["string", "null"]},
        "machine": {"type": "object", "required": ["cpu", "cores", "torch", "transformers", "device"]},
        "workload": {"type": "object", "required": ["name", "num_requests", "prompt_tokens", "output_tokens"]},
    }
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": schema_id, "type": "object",
            "required": [*common, *properties], "properties": {**common, **properties}}

SERVING_SCHEMA_ID = "asyncbatch-bench-serving/1"
_SERVING_SUMMARY = {
    "type": "object",
    "required": ["num_requests", "completed", "failed", "failure_reasons", "duration_s", "prompt_tokens",
                 "output_tokens", "outputs_not_max_tokens", "request_throughput", "output_throughput",
                 "total_token_throughput", "goodput", "slo_attainment", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"],
    "properties": {
        "num_requests": INT0, "completed": INT0, "failed": INT0, "output_tokens": INT0,
        "outputs_not_max_tokens": INT0,
        "failure_reasons": {"type": "array", "items": {"type": "object", "required": ["error", "count"]}},
        "duration_s": {"type": "number", "minimum": 0},
        "request_throughput": {"type": "number", "minimum": 0},
        "output_throughput": {"type": "number", "minimum": 0},
        "goodput": {"type": "number", "minimum": 0},
        "ttft_ms": DISTRIBUTION, "tpot_ms": DISTRIBUTION, "itl_ms": DISTRIBUTION, "e2e_ms": DISTRIBUTION,
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
SERVING_SCHEMA: dict = document_schema(SERVING_SCHEMA_ID, ["serving"], {
    "settings": {"type": "object", "required": ["device", "dtype", "temperature", "ignore_eos", "slo",
                                                "prompt_format", "endpoint"]},
    "loads": {"type": "array", "items": {"type": "object", "required": ["request_rate", "label"]}},
    "systems": {"type": "array", "items": {
        "type": "object", "required": ["name", "description", "dialect", "base_url", "command", "served_model",
                                       "points"],
        "properties": {"name": {"type": "string"}, "points": {"type": "array", "items": _SERVING_POINT}}}},
    "comparisons": {"type": "array", "items": {
        "type": "object", "required": ["load", "numerator", "denominator", "output_throughput_ratio",
                                       "p99_ttft_ratio", "p99_tpot_ratio"]}},
    "notes": {"type": "array", "items": {"type": "string"}},
    "plots": {"type": "array", "items": {"type": "string"}},
})

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(value: object, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def validation_errors(doc: object, schema: dict, path: str = "$") -> list[str]:
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


def validate(doc: object, schema: dict, what: str) -> None:
    """Raise ``ValueError`` listing the first problems if ``doc`` breaks ``schema`` (``what``: its name)."""
    errors = validation_errors(doc, schema)
    if errors:
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        raise ValueError(f"invalid {what}: " + "; ".join(errors[:10]) + more)
