"""The structured-output case catalogue: constraints, and a check that a finished text satisfies each.

``CASES`` is what the grammar tests (``tests/test_grammar.py``), the engine's structured-output tests and
``scripts/grammar_backends.py`` run: 17 JSON schemas (one given as text), 1 ``json_object``, 6 regexes,
4 choices and 3 grammars. ``check(text)`` raises ``AssertionError`` when ``text`` does not satisfy the case.

Every string is short-bounded (``maxLength``, bounded repeats) and every collection small, so a random
walk through the allowed tokens (what a tiny model with random weights does) usually finishes within a
few dozen tokens. Grammars are written in GBNF/EBNF (``root ::= ...``, xgrammar's own syntax, which
llguidance converts) and one in Lark (``start: ...``, llguidance's own, which xgrammar parses too), so
every case compiles on both libraries.

``BAD_CASES`` are ``(field, kwargs)`` pairs: ``StructuredOutputsParams(**kwargs)`` or compiling it must
raise ``ValueError`` whose message starts ``structured_outputs.<field>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncbatch.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class StructuredCase:
    name: str
    params: StructuredOutputsParams
    check: Callable[[str], None]


def _schema_check(schema: dict[str, Any]) -> Callable[[str], None]:
    def check(text: str) -> None:
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError as exc:
            raise AssertionError(f"not JSON: {text!r} ({exc})") from None
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            raise AssertionError(f"{text!r} does not match the schema: {exc.message}") from None
    return check


def _object_check(text: str) -> None:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise AssertionError(f"not JSON: {text!r} ({exc})") from None
    assert isinstance(value, dict), f"not a JSON object: {text!r}"


def _regex_check(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"
    return check


def _choice_check(choices: tuple[str, ...]) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in choices, f"{text!r} is not one of {choices}"
    return check


def _arithmetic_check(text: str) -> None:
    """``expr := term (("+"|"-") term)*``, ``term := factor (("*"|"/") factor)*``,
    ``factor := [0-9]{1,3} | "(" expr ")"``, no spaces."""
    pos = 0

    def expect(ok: bool, what: str) -> None:
        assert ok, f"{text!r}: expected {what} at {pos}"

    def factor() -> None:
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            expr()
            expect(text[pos:pos + 1] == ")", "')'")
            pos += 1
            return
        digits = re.match(r"[0-9]{1,3}", text[pos:])
        expect(digits is not None, "a number")
        pos += digits.end()
        expect(not text[pos:pos + 1].isdigit(), "at most 3 digits")

    def chain(inner: Callable[[], None], ops: str) -> None:
        nonlocal pos
        inner()
        while text[pos:pos + 1] and text[pos] in ops:
            pos += 1
            inner()

    def expr() -> None:
        chain(lambda: chain(factor, "*/"), "+-")

    expr()
    expect(pos == len(text), "the end")


FRUITS = ("apple", "banana", "cherry", "date")


def _fruit_list_check(text: str) -> None:
    words = text.split(", ")
    assert 1 <= len(words) <= 4 and all(w in FRUITS for w in words), f"{text!r} is not a list of 1-4 fruits"


def _assignments_check(text: str) -> None:
    assert re.fullmatch(r"[a-z]{1,4}=[0-9]{1,3}(; [a-z]{1,4}=[0-9]{1,3})*", text), \
        f"{text!r} is not 'name=number; ...'"


SHORT = {"type": "string", "maxLength": 8}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}

SCHEMAS: dict[str, dict[str, Any]] = {
    "json_person": {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "json_nested_address": {
        "type": "object",
        "properties": {"user": {"type": "object",
                                "properties": {"id": DIGIT,
                                               "address": {"type": "object",
                                                           "properties": {"city": SHORT,
                                                                          "zip": {"type": "string",
                                                                                  "pattern": "^[0-9]{5}$"}},
                                                           "required": ["city", "zip"],
                                                           "additionalProperties": False}},
                                "required": ["id", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "json_int_array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                       "minItems": 1, "maxItems": 4},
    "json_enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                       "level": {"enum": [1, 2, 3, None]}},
        "required": ["color", "size", "level"], "additionalProperties": False},
    "json_optional_fields": {
        "type": "object",
        "properties": {"id": DIGIT, "note": {"type": "string", "maxLength": 6},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
        "required": ["id"], "additionalProperties": False},
    "json_bool_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "error": {"type": "null"}},
        "required": ["ok", "error"], "additionalProperties": False},
    "json_any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [DIGIT, {"type": "string", "maxLength": 3}, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False},
    "json_number_range": {"type": "number", "minimum": 0, "maximum": 1},
    "json_short_string": {"type": "string", "minLength": 2, "maxLength": 10},
    "json_const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "event"}, "ok": {"type": "boolean"}},
        "required": ["version", "kind", "ok"], "additionalProperties": False},
    "json_array_of_objects": {
        "type": "array", "maxItems": 3,
        "items": {"type": "object", "properties": {"x": DIGIT, "y": DIGIT}, "required": ["x", "y"],
                  "additionalProperties": False}},
    "json_ref_defs": {
        "$defs": {"point": {"type": "object", "properties": {"x": DIGIT, "y": DIGIT}, "required": ["x", "y"],
                            "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "json_recursive_tree": {
        "$defs": {"node": {"type": "object",
                           "properties": {"v": DIGIT,
                                          "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                   "maxItems": 2}},
                           "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node"},
    "json_tuple": {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0, "maximum": 99},
                        {"type": "boolean"}],
        "items": False, "minItems": 3},
    "json_string_pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "json_exclusive_bounds": {
        "type": "object",
        "properties": {"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                       "label": {"type": "string", "minLength": 1, "maxLength": 5}},
        "required": ["score", "label"], "additionalProperties": False},
}

REGEXES: dict[str, str] = {
    "regex_phone": r"[0-9]{3}-[0-9]{4}",
    "regex_date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "regex_email": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    "regex_hex_color": r"#[0-9a-fA-F]{6}",
    "regex_words": r"(yes|no|maybe)( please)?",
    "regex_greek": r"[αβγ]{1,3}!",
}

CHOICES: dict[str, tuple[str, ...]] = {
    "choice_sentiment": ("positive", "negative", "neutral"),
    "choice_yes_no": ("yes", "no"),
    "choice_prefixes": ("cat", "category", "cattle"),
    "choice_unicode": ("café", "naïve", "日本"),
}

GRAMMARS: dict[str, tuple[str, Callable[[str], None]]] = {
    "grammar_arithmetic": (('root ::= expr\n'
                           'expr ::= term (("+" | "-") term)*\n'
                           'term ::= factor (("*" | "/") factor)*\n'
                           'factor ::= num | "(" expr ")"\n'
                           'num ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]\n'), _arithmetic_check),
    "grammar_fruit_list": (('root ::= fruit (", " fruit)? (", " fruit)? (", " fruit)?\n'
                           'fruit ::= "apple" | "banana" | "cherry" | "date"\n'), _fruit_list_check),
    "grammar_lark_assignments": (('start: pair ("; " pair)*\n'
                                 'pair: NAME "=" NUMBER\n'
                                 'NAME: /[a-z]{1,4}/\n'
                                 'NUMBER: /[0-9]{1,3}/\n'), _assignments_check),
}


def _cases() -> list[StructuredCase]:
    cases = [StructuredCase(name, StructuredOutputsParams(json=schema), _schema_check(schema))
             for name, schema in SCHEMAS.items()]
    # One schema given as JSON text, the way an HTTP request carries it.
    text_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                   "additionalProperties": False}
    cases.append(StructuredCase("json_schema_as_text", StructuredOutputsParams(json=json.dumps(text_schema)),
                                _schema_check(text_schema)))
    cases.append(StructuredCase("json_object", StructuredOutputsParams(json_object=True), _object_check))
    cases += [StructuredCase(name, StructuredOutputsParams(regex=pattern), _regex_check(pattern))
              for name, pattern in REGEXES.items()]
    cases += [StructuredCase(name, StructuredOutputsParams(choice=list(choices)), _choice_check(choices))
              for name, choices in CHOICES.items()]
    cases += [StructuredCase(name, StructuredOutputsParams(grammar=text), check)
              for name, (text, check) in GRAMMARS.items()]
    return cases


CASES: list[StructuredCase] = _cases()
CASES_BY_NAME: dict[str, StructuredCase] = {case.name: case for case in CASES}

# JSON Schema features past the catalogue's core, for the coverage column of scripts/grammar_backends.py:
# a library may refuse one (an honest failure) or compile it while ignoring the keyword (a walk then
# produces text its check rejects). Not required by the tests.
EXTRA_SCHEMAS: dict[str, Any] = {
    "extra_all_of": {"allOf": [{"type": "object", "properties": {"a": DIGIT}, "required": ["a"]},
                               {"properties": {"b": DIGIT}, "required": ["b"]}]},
    "extra_one_of": {"type": "object", "properties": {"v": {"oneOf": [DIGIT, {"type": "boolean"}]}},
                     "required": ["v"], "additionalProperties": False},
    "extra_format_date": {"type": "string", "format": "date"},
    "extra_format_uuid": {"type": "string", "format": "uuid"},
    "extra_pattern_properties": {"type": "object", "patternProperties": {"^x_[a-z]$": DIGIT},
                                 "additionalProperties": False, "maxProperties": 2},
    "extra_min_properties": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "minProperties": 1,
                             "additionalProperties": False},
    "extra_unique_items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2},
                           "uniqueItems": True, "minItems": 2, "maxItems": 3},
    "extra_multiple_of": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
    "extra_if_then": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                      "if": {"properties": {"a": {"const": 1}}, "required": ["a"]}, "then": {"required": ["b"]},
                      "additionalProperties": False},
    "extra_not": {"not": {"type": ["string", "object", "array", "number"]}},
    "extra_contains": {"type": "array", "items": DIGIT, "contains": {"const": 3}, "maxItems": 3},
    "extra_dependent_required": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                                 "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
    "extra_property_names": {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,3}$"},
                             "additionalProperties": DIGIT, "maxProperties": 2},
    "extra_enum_mixed": {"enum": ["a", 1, True, None, {"k": 1}, [1, 2]]},
    "extra_true_schema": True,
}
# Texts each extra schema forbids: a library that compiles the schema must refuse them (xgrammar 0.2.9
# accepted every one of these before asyncbatch refused the keywords it ignores).
EXTRA_VIOLATIONS: dict[str, tuple[str, ...]] = {
    "extra_all_of": ('{"a": 1}', "[]"),
    "extra_one_of": ('{"v": "x"}',),
    "extra_min_properties": ("{}",),
    "extra_unique_items": ("[0, 0]",),
    "extra_if_then": ('{"a": 1}',),
    "extra_not": ('"x"', "1"),
    "extra_contains": ("[1]",),
    "extra_dependent_required": ('{"a": 1}',),
    "extra_property_names": ('{"ABCD": 1}',),
    "extra_multiple_of": ("7",),
}
EXTRA_CASES: list[StructuredCase] = [StructuredCase(name, StructuredOutputsParams(json=schema), _schema_check(schema))
                                     for name, schema in EXTRA_SCHEMAS.items()]

BAD_CASES: list[tuple[str, dict[str, Any]]] = [
    ("json", {"json": "{not json"}),
    ("json", {"json": {"type": "wibble"}}),
    ("json", {"json": {"$ref": "#/$defs/nowhere"}}),
    ("json", {"json": {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}},
                       "required": ["a"]}}),
    ("json", {"json": {"type": "string", "pattern": "(unclosed"}}),
    ("json", {"json": {"type": "object", "properties": {"a": {"type": 42}}}}),
    ("regex", {"regex": "(abc"}),
    ("regex", {"regex": "[z-a]"}),
    ("regex", {"regex": "a{5,2}"}),
    ("regex", {"regex": "abc)"}),
    ("choice", {"choice": []}),
    ("choice", {"choice": ["ok", ""]}),
    ("grammar", {"grammar": ""}),
    ("grammar", {"grammar": "   \n"}),
    ("grammar", {"grammar": 'root ::= ("a"'}),
    ("grammar", {"grammar": "root ::= undefined_rule"}),
    ("grammar", {"grammar": "start: missing_rule"}),
    ("grammar", {"grammar": "this is not a grammar"}),
    # Nested past what a parser or a compile can afford: refused, quickly, not a crash or a hang.
    ("regex", {"regex": "(" * 5000 + "a" + ")" * 5000}),
    ("grammar", {"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000}),
    ("json", {"json": '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000}),
    ("json", {"json": json.loads('{"type": "array", "items": ' * 200 + "{}" + "}" * 200)}),
    ("json", {"json": {"type": "integer", "minimum": -10 ** 30, "maximum": 10 ** 30}}),
]
