"""Output constraints over HTTP: ``response_format`` (text, json_object, json_schema) and vLLM's ``guided_*`` /
``structured_outputs`` fields on both endpoints, refusals that name the field, and, on the default model with
the ``openai`` client, ``response_format={"type": "json_schema", ...}`` and tool calls enforced by the tools'
schema (``tool_choice="required"`` and a named function)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")
openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install -e '.[serve]')")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar", reason="the structured extra is not installed (pip install -e '.[structured]')")

from pydantic import BaseModel

from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.protocol import ChatCompletionRequest, CompletionRequest
from asyncbatch.serve.sampling import structured_outputs
from asyncbatch.serve.settings import ServeSettings
from asyncbatch.structured_outputs import StructuredOutputsParams
from tests.serve_harness import client, serving
from tests.tiny_models import save_tiny_model

SCHEMA = {"type": "object", "properties": {"size": {"type": "string", "enum": ["small", "large"]},
                                           "count": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["size", "count"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "hi"}]


def chat_body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=CHAT, **fields)


@pytest.mark.parametrize(("fields", "expected", "source"), [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA), "response_format"),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA)), "guided_json"),
    ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+"), "guided_regex"),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"]), "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"'), "guided_grammar"),
    ({"structured_outputs": {"choice": ["a"]}}, StructuredOutputsParams(choice=["a"]), "structured_outputs"),
    ({"structured_outputs": {"json_object": True, "regex": None}}, StructuredOutputsParams(json_object=True),
     "structured_outputs"),
])
def test_constraint_fields_map_to_structured_outputs(fields: dict, expected, source) -> None:
    assert structured_outputs(chat_body(**fields)) == (expected, source)
    assert structured_outputs(CompletionRequest(prompt="x", **fields)) == (expected, source)


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both constrain"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice", "both constrain"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs", "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown: pattern"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format",
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": ""}, "guided_regex", "non-empty"),
])
def test_bad_constraints_name_the_field(fields: dict, param: str, words: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        structured_outputs(chat_body(**fields))
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


def test_tools_schema_conflicts_with_another_constraint() -> None:
    assert structured_outputs(chat_body(), {"type": "object"}) == (StructuredOutputsParams(json={"type": "object"}),
                                                                   "tools")
    with pytest.raises(OpenAIError) as caught:
        structured_outputs(chat_body(response_format={"type": "json_object"}), {"type": "object"})
    assert caught.value.param == "response_format" and "tool_choice" in caught.value.message


# -- end to end on a tiny model: any model's output obeys the constraint ----------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tiny"), "LlamaForCausalLM", max_position_embeddings=512)
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    with serving(ServeSettings(("tiny",)), str(model), device="cpu", dtype="float32", max_num_seqs=4,
                 engine_process=False, chat_template=template) as pair:
        yield pair


def post(http, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(http, path: str, body: dict) -> str:
    text = ""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return text


CONSTRAINED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"guided_regex": "[0-9]{3}-[a-c]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-c]{2}", text) is not None),
    ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"guided_grammar": 'root ::= ("yes" | "no") "!"'}, lambda text: text in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
]


@pytest.mark.parametrize(("fields", "check"), CONSTRAINED, ids=[next(iter(c[0])) for c in CONSTRAINED])
def test_constrained_output_on_both_endpoints(tiny, fields: dict, check) -> None:
    server, _engine = tiny
    with client(server) as http:
        for path, body in (("/v1/completions", {"prompt": "Answer:"}), ("/v1/chat/completions", {"messages": CHAT})):
            body = {**body, **fields, "max_tokens": 60, "temperature": 0}
            out = post(http, path, body)
            choice = out["choices"][0]
            text = choice.get("text", choice.get("message", {}).get("content"))
            assert check(text), (path, text)
            assert choice["finish_reason"] == "stop"
            assert streamed_text(http, path, body) == text
        sampled = post(http, "/v1/completions", {"prompt": "Answer:", **fields, "max_tokens": 60, "n": 3,
                                                 "temperature": 1.5, "seed": 7})
        assert all(check(c["text"]) for c in sampled["choices"])


def test_bad_constraints_over_http_then_good(tiny) -> None:
    server, _engine = tiny
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "this is not a grammar"}, "guided_grammar"),
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ]
    with client(server) as http:
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
            for extra, param in cases:
                response = http.post(path, json={**body, "max_tokens": 2, **extra})
                assert response.status_code == 400, (path, extra, response.text)
                assert response.json()["error"]["param"] == param, response.text
            assert post(http, path, {**body, "max_tokens": 2, "ignore_eos": True})["usage"]["completion_tokens"] == 2


# -- the default model with the openai client: one server for every check ---------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def smol():
    with serving(ServeSettings(("smol",)), device="cpu", dtype="float32", max_num_seqs=4, seed=0) as (server, _):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.model
def test_default_model_json_schema_with_the_openai_client(smol) -> None:
    ask = [{"role": "user", "content": "Give me a person as JSON."}]
    out = smol.chat.completions.create(
        model="smol", messages=ask, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    Person.model_validate_json(out.choices[0].message.content)  # what chat.completions.parse does with it


@pytest.mark.model
def test_default_model_tool_calls_with_the_openai_client(smol) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = smol.chat.completions.create(model="smol", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=80, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id.startswith("call_") and call.type == "function"
    named = smol.chat.completions.create(model="smol", messages=ask, tools=[WEATHER, TIME], max_tokens=60,
                                         temperature=0, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    # OpenAI's (and vLLM's) rule: a forced named call ends in "stop", auto and required calls in "tool_calls".
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
