"""What a request asks its output to match: a JSON schema, any JSON object, a regex, a choice or a grammar.

Field names follow vLLM's ``StructuredOutputsParams``. Exactly one kind is set.
Checks here are about types and shape only; whether a schema, regex or grammar
compiles is decided by the grammar library at submission
(``asyncbatch.sampling.grammar``), which raises ``ValueError`` naming
``structured_outputs.<field>``.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output.

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON
    object; ``regex``: the whole output matches it; ``choice``: the output is one
    of these strings; ``grammar``: a GBNF/EBNF (``root ::= ...``) or Lark
    (``start: ...``) grammar, taken by either library (docs/structured-output.md).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json_module.loads(self.json)
                except (ValueError, RecursionError) as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise TypeError(f"structured_outputs.json must be a JSON schema (an object), got "
                                f"{type(schema).__name__}")
        if not isinstance(self.json_object, bool):
            raise TypeError("structured_outputs.json_object must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in KINDS if self._is_set(k)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(kinds) if kinds else 'none'}")

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """Which of ``KINDS`` this constraint is."""
        return next(k for k in KINDS if self._is_set(k))

    @property
    def schema_text(self) -> str | None:
        """The JSON schema as text (``json`` only), the form grammar libraries take."""
        if self.json is None:
            return None
        # Key order is kept: the grammar libraries generate an object's properties in the schema's order.
        return self.json if isinstance(self.json, str) else json_module.dumps(self.json)

    def key(self) -> tuple[str, str]:
        """A hashable identity: equal keys compile to the same grammar (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            return kind, self.schema_text or ""
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json_module.dumps(list(self.choice))
        return kind, getattr(self, kind)
