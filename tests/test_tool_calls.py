"""Tool calling: the Hermes parser (whole, and streamed split at every character boundary), the JSON-array and
named-function parsers, the request's tools and tool_choice checks, the rendered tool prompt, and end to end
with the ``openai`` client on a tiny model whose output a ``guided_choice`` / the tools' schema fixes.

The default model's tool calls (``required``, a named function) are in ``test_serve_structured.py``, which
holds the one default-model server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")
openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install -e '.[serve]')")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar", reason="the structured extra is not installed (pip install -e '.[structured]')")

from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.settings import ServeSettings
from asyncbatch.serve.tool_calls import (
    parse_tool_choice,
    parse_tools,
    plan_tools,
    template_inputs,
    template_supports_tools,
)
from asyncbatch.serve.tool_parser import (
    ArgumentsParser,
    HermesParser,
    JsonArrayParser,
    Parsed,
    ToolCallParser,
    parse_whole,
)
from tests.serve_harness import client, serving
from tests.tiny_models import build_byte_tokenizer, save_tiny_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC"]}},
                                       "required": ["zone"], "additionalProperties": False}}}

# (model output, content, [(name, arguments)])
HERMES_CASES = [
    ("Plain text, no calls. <b>tags</b> and a < sign  ", "Plain text, no calls. <b>tags</b> and a < sign  ", []),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (('<tool_call>{"name": "a", "arguments": {"q": "}} </tool_call"}}</tool_call>\n\n'
      '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n'),
     None, [("a", '{"q": "}} </tool_call"}'), ("b", "{}")]),
    ('<tool_call>{"arguments": {"x": 1}, "name": "later"}</tool_call> done', "done", [("later", '{"x": 1}')]),
    ("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    ('<tool_call>{"name": "cut", "arguments": {"a": [1, 2', None, [("cut", '{"a": [1, 2')]),
    ('<tool_call>\n{"name": "esc\\"aped", "parameters": {"k": "v"}}\n</tool_call>', None,
     [('esc"aped', '{"k": "v"}')]),
    ("ends with a partial tag <tool_", "ends with a partial tag <tool_", []),
]


def collect(parts: list[Parsed]) -> tuple[str | None, list[tuple[str, str]]]:
    """Streamed parts -> (content, [(name, arguments)]), checking the stream's shape on the way: a call's
    first part has its id and name, later parts only arguments, indices in order."""
    content, calls, ids = "", [], []
    for parsed in parts:
        content += parsed.content
        for part in parsed.calls:
            chunk = part.as_chunk()
            if part.id is not None:
                assert part.index == len(calls) and chunk["id"].startswith("call_") and chunk["type"] == "function"
                calls.append([chunk["function"]["name"], chunk["function"]["arguments"]])
                ids.append(chunk["id"])
            else:
                assert set(chunk) == {"index", "function"} and set(chunk["function"]) == {"arguments"}
                calls[part.index][1] += chunk["function"]["arguments"]
    assert len(set(ids)) == len(ids)
    return (content if content or not calls else None), [tuple(c) for c in calls]


def whole(parser: ToolCallParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_whole(parser, text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_whole_and_split_at_every_boundary(text: str, content: str | None, calls: list) -> None:
    assert whole(HermesParser(), text) == (content, calls)
    for cut in range(len(text) + 1):
        parser = HermesParser()
        parts = [parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]
        assert collect(parts) == (content, calls), f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    parser = HermesParser()
    assert collect([parser.feed(ch) for ch in text] + [parser.finish()]) == (content, calls)


def test_hermes_streams_arguments_before_the_block_closes() -> None:
    parser = HermesParser()
    assert parser.feed("Hi <tool").content == "Hi"  # the possible start of the tag is held back
    head = parser.feed('_call>{"name": "f", "arguments": {"city": "Pa')
    assert [(p.name, p.arguments) for p in head.calls] == [("f", '{"city": "Pa')]
    assert parser.feed('ris"}').calls[0].arguments == 'ris"'  # the '}' may close the outer object: held
    tail = parser.feed("}\n</tool_call>").add(parser.finish())
    assert [p.arguments for p in tail.calls] == ["}"] and tail.content == ""


def test_json_array_and_named_parsers_split_everywhere() -> None:
    array = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    expected = (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    named = '  {"city": "Rome"} \n'
    for cut in range(len(array) + 1):
        parser = JsonArrayParser()
        assert collect([parser.feed(array[:cut]), parser.feed(array[cut:]), parser.finish()]) == expected
    for cut in range(len(named) + 1):
        parser = ArgumentsParser("get_weather")
        got = collect([parser.feed(named[:cut]), parser.feed(named[cut:]), parser.finish()])
        assert got == (None, [("get_weather", '{"city": "Rome"}')])
    assert whole(JsonArrayParser(), "not an array") == ("not an array", [])
    assert whole(JsonArrayParser(), '[{"nom": 1}]') == ('[{"nom": 1}]', [])
    # An object in another order is read when whole (its arguments serialised); one cut short as if it closed.
    assert whole(JsonArrayParser(), '[{"arguments": {"x":1}, "name": "later"}]') == (None, [("later", '{"x": 1}')])
    assert whole(JsonArrayParser(), '[{"name": "cut", "arguments": {"a": [1, 2') == (None, [("cut", '{"a": [1, 2')])


def test_json_array_streams_arguments_before_the_object_closes() -> None:
    parser = JsonArrayParser()
    head = parser.feed('[{"name": "f", "arguments": {"city": "Pa')
    assert [(p.name, p.arguments) for p in head.calls] == [("f", '{"city": "Pa')]
    assert parser.feed('ris"}').calls[0].arguments == 'ris"'  # the '}' may close the outer object: held
    second = parser.feed('}, {"name": "g", "arguments": {}')
    assert [(p.index, p.name, p.arguments) for p in second.calls] == [(0, None, "}"), (1, "g", "{")]
    tail = parser.feed("}]").add(parser.finish())
    assert [(p.index, p.arguments) for p in tail.calls] == [(1, "}")] and tail.content == ""


BAD_TOOLS = [
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}],
     "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "x", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([WEATHER, WEATHER], "given twice"),
    ([{"type": "retrieval"}], "tools[0].type"),
]


@pytest.mark.parametrize(("tools", "where"), BAD_TOOLS)
def test_bad_tools_name_the_field(tools: list, where: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_tools(tools)
    assert caught.value.status == 400 and caught.value.param == "tools" and where in caught.value.message


def test_tool_choice() -> None:
    tools = parse_tools([WEATHER, TIME])
    assert parse_tool_choice(None, tools) == ("auto", None)
    assert parse_tool_choice(None, []) == ("none", None)
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools) == ("named", "get_time")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"function": "get_time"}):
        with pytest.raises(OpenAIError) as caught:
            parse_tool_choice(bad, tools)
        assert caught.value.param == "tool_choice"
    with pytest.raises(OpenAIError, match="needs tools"):
        parse_tool_choice("required", [])
    assert plan_tools([WEATHER], "none", None) is None


def test_required_schema_accepts_calls_and_refuses_others() -> None:
    nested = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
        "$defs": {"Item": {"type": "string", "enum": ["a", "b"]}}}}}
    schema = plan_tools([WEATHER, nested], "required", None).schema()
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Rome"}},
                         {"name": "pick", "arguments": {"item": "a"}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"city": "Oslo"}}], [{"name": "pick", "arguments": {}}],
                [{"name": "other", "arguments": {}}], {"name": "get_weather", "arguments": {"city": "Rome"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools([WEATHER], "required", False).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Rome"}}] * 2, single)
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.schema() == TIME["function"]["parameters"]
    assert plan_tools([WEATHER], "auto", None).schema() is None


CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WITH_TOOLS = ("{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
              "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
              "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
              "\n{% endfor %}")
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def test_tools_rendered_into_a_template_without_tools() -> None:
    assert not template_supports_tools(CHATML) and template_supports_tools(WITH_TOOLS)
    plan = plan_tools([WEATHER], "auto", None)
    messages, kwargs = template_inputs([{"role": "system", "content": "Be brief."}, *HISTORY], plan, False)
    assert kwargs == {}
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER["function"]["parameters"]) in system
    assert "<tool_call>" in system and '{"name": <function-name>, "arguments": <args-json-object>}' in system
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content":
                           "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"}
    assert len(messages) == 4
    tokenizer = build_byte_tokenizer()
    text = tokenizer.apply_chat_template(messages, chat_template=CHATML, tokenize=False)
    assert text.startswith("<|system|>Be brief.\n\n# Tools") and "<|user|><tool_response>" in text
    no_system, _ = template_inputs(HISTORY[:1], plan, False)
    assert no_system[0]["role"] == "system" and no_system[0]["content"].startswith("# Tools")


def test_tools_given_to_a_template_that_renders_them() -> None:
    plan = plan_tools([WEATHER, TIME], "auto", None)
    messages, kwargs = template_inputs(HISTORY, plan, True)
    assert kwargs == {"tools": [WEATHER, TIME]}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # objects, as HF templates take
    text = build_byte_tokenizer().apply_chat_template(messages, chat_template=WITH_TOOLS, tokenize=False, **kwargs)
    assert text.startswith("<|tools|>get_weather;get_time;<|user|>") and "[get_weather Paris][get_weather Rome]" in text


# -- end to end ------------------------------------------------------------------------------------------------
FORCED = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tiny"), "LlamaForCausalLM", max_position_embeddings=2048)
    with serving(ServeSettings(("tiny",)), str(model), device="cpu", dtype="float32", max_num_seqs=4,
                 engine_process=False, chat_template=CHATML) as pair:
        yield pair


def api_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def streamed_calls(stream) -> tuple[str, dict[int, dict], list[str | None]]:
    content, calls, finishes = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            # A chunk says something: held-back text (a call being parsed) sends no empty delta.
            assert delta.role or delta.content or delta.tool_calls or choice.finish_reason or choice.logprobs, chunk
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function" and call.function.name
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return content, calls, finishes


def test_auto_tool_calls_parsed_whole_and_streamed(served) -> None:
    server, _engine = served
    api = api_for(server)
    kwargs = {"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 200,
              "extra_body": {"guided_choice": [FORCED]}}
    out = api.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    content, calls, finishes = streamed_calls(api.chat.completions.create(stream=True, **kwargs))
    assert content == "Sure." and finishes == ["tool_calls"]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]


def test_required_and_named_are_enforced_on_any_model(served) -> None:
    server, _engine = served
    api = api_for(server)
    base = {"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 120}
    out = api.chat.completions.create(tool_choice="required", **base)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    content, streamed, finishes = streamed_calls(api.chat.completions.create(tool_choice="required", stream=True,
                                                                              **base))
    assert finishes == ["tool_calls"] and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [(c.function.name, c.function.arguments)
                                                                        for c in calls]
    named = {"type": "function", "function": {"name": "get_time"}}
    out = api.chat.completions.create(tool_choice=named, **base)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
    assert out.choices[0].finish_reason == "stop"  # a forced named call, as OpenAI and vLLM answer it
    content, streamed, finishes = streamed_calls(api.chat.completions.create(tool_choice=named, stream=True, **base))
    assert streamed[0]["name"] == "get_time" and json.loads(streamed[0]["arguments"]) == {"zone": "UTC"}
    assert finishes == ["stop"]


def test_tool_choice_none_leaves_the_tools_out(served) -> None:
    server, _engine = served
    with client(server) as http:
        body = {"model": "tiny", "messages": ASK, "max_tokens": 3, "temperature": 0}
        plain = http.post("/v1/chat/completions", json=body).json()
        none = http.post("/v1/chat/completions", json={**body, "tools": [WEATHER], "tool_choice": "none"}).json()
        auto = http.post("/v1/chat/completions", json={**body, "tools": [WEATHER]}).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert none["choices"][0]["message"] == plain["choices"][0]["message"]
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + len(json.dumps(WEATHER))


def test_bad_tool_requests_then_good(served) -> None:
    server, _engine = served
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2}
    cases = [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}], "tool_choice": "required"}, "tools"),
    ]
    with client(server) as http:
        for extra, param in cases:
            response = http.post("/v1/chat/completions", json={**body, **extra})
            assert response.status_code == 400, (extra, response.text)
            assert response.json()["error"]["param"] == param, response.text
        good = http.post("/v1/chat/completions", json=body)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
