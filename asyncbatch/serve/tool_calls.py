"""Tool calling for ``/v1/chat/completions``: ``tools`` + ``tool_choice`` -> the prompt, the output constraint,
and the parser that turns the output into ``tool_calls`` (``tool_parser``).

    tool_choice           prompt                        output constraint                    parser
    none (default         tools left out                -                                    -
      without tools)
    auto (default         in the template, or our       -                                    HermesParser
      with tools)           system message (below)
    required              same                          schema [{"name", "arguments"}, ...]  JsonArrayParser
    {"type": "function",  same                          N's parameters schema                ArgumentsParser
     "function": {"name": N}}

The tools go to the chat template as ``tools=`` when the template refers to ``tools``; otherwise (the default
model's template has no tool section) they are rendered into the system message in Hermes format
(``TOOLS_PROMPT``: the Hermes tags Qwen's templates use, in our own words), and earlier turns are rewritten to the same format: an assistant's
``tool_calls`` become ``<tool_call>`` blocks in its content, ``tool`` messages become a user turn of
``<tool_response>`` blocks. With a template that knows tools, ``arguments`` strings of earlier calls are
given to it as objects (vLLM does the same; HF templates ``tojson`` them).

Invalid tools and a named ``tool_choice`` that is not among them are 400s whose ``param`` is ``tools`` /
``tool_choice`` and whose message names the exact place (``tools[1].function.parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.tool_parser import (
    CLOSE,
    OPEN,
    ArgumentsParser,
    HermesParser,
    JsonArrayParser,
    ToolCallParser,
)

TOOLS_PROMPT = """# Tools

You can call {how} when it helps to answer the user.

Each function you can call is described by one JSON object between <tools> and </tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and its arguments between <tool_call> and \
</tool_call>:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_MODES = ("none", "auto", "required")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _refuse(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    spec: dict[str, Any]  # {"type": "function", "function": {...}} as the template and the prompt show it


def parse_tools(tools: list[dict[str, Any]]) -> list[Tool]:
    """The request's ``tools``, checked: function tools, each with a unique name and an object schema."""
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise _refuse("tools", f"{where}.type must be 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _refuse("tools", f"{where}.function must be an object with a 'name'")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise _refuse("tools", f"{where}.function.name must be a non-empty string, got {name!r}")
        if any(t.name == name for t in out):
            raise _refuse("tools", f"{where}.function.name {name!r} is given twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _refuse("tools", f"{where}.function.description must be a string")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise _refuse("tools", f"{where}.function.parameters must be a JSON schema of type 'object', "
                          f"got {json.dumps(parameters)[:200]}")
        spec_function = {"name": name, **({"description": description} if description else {}),
                         "parameters": parameters}
        out.append(Tool(name, parameters, {"type": "function", "function": spec_function}))
    return out


def parse_tool_choice(choice: str | dict[str, Any] | None, tools: list[Tool]) -> tuple[str, str | None]:
    """(mode, function name for a named choice); OpenAI's default is ``auto`` with tools, ``none`` without."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in _MODES:
            raise _refuse("tool_choice", f"tool_choice must be one of {', '.join(_MODES)} or "
                          f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
        if choice != "none" and not tools:
            raise _refuse("tool_choice", f"tool_choice={choice!r} needs tools")
        return choice, None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise _refuse("tool_choice", "a named tool_choice is {'type': 'function', 'function': {'name': ...}}, "
                      f"got {json.dumps(choice)[:200]}")
    if not any(t.name == name for t in tools):
        raise _refuse("tool_choice", f"tool_choice names the function {name!r}, which is not in tools "
                      f"({', '.join(t.name for t in tools) or 'none given'})")
    return "named", name


def template_supports_tools(template: object) -> bool:
    """Whether the chat template renders ``tools`` itself (its text refers to them)."""
    if isinstance(template, dict):
        return any(template_supports_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools (``plan_tools``)."""

    tools: list[Tool]
    mode: str  # auto, required or named
    name: str | None = None  # the named function
    parallel: bool = True

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema that enforces ``required`` / a named function (``None`` for ``auto``)."""
        if self.mode == "named":
            return next(t.parameters for t in self.tools if t.name == self.name)
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        variants = []
        for tool in self.tools:
            parameters = dict(tool.parameters)
            for key in ("$defs", "definitions"):  # "#/$defs/X" refers to the document's root: lift them there
                for def_name, definition in (parameters.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                        raise _refuse("tools", f"tools define {key}/{def_name} differently; rename one")
            variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                              "arguments": parameters},
                             "required": ["name", "arguments"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {**schema, **defs}

    def parser(self) -> ToolCallParser:
        if self.mode == "named":
            return ArgumentsParser(self.name or "")
        return JsonArrayParser() if self.mode == "required" else HermesParser()

    def system_prompt(self) -> str:
        """The tools in Hermes format, for a template that does not render tools."""
        how = "one or more functions" if self.parallel else "one function"
        text = TOOLS_PROMPT.format(how=how, tools="\n".join(json.dumps(t.spec, ensure_ascii=False)
                                                            for t in self.tools))
        if self.mode == "required":
            text += ("\n\nYou must call at least one function. Answer with a JSON array of the calls only: "
                     '[{"name": <function-name>, "arguments": <args-json-object>}]')
        elif self.mode == "named":
            text += f"\n\nYou must call the function {self.name}. Answer with its arguments only, as a JSON object."
        return text


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's tool plan, or None when the tools play no part (none given, or ``tool_choice="none"``:
    then they are left out of the prompt and the output is plain text)."""
    parsed = parse_tools(tools or [])
    mode, name = parse_tool_choice(tool_choice, parsed)
    if mode == "none":
        return None
    return ToolPlan(parsed, mode, name, parallel_tool_calls is not False)


def template_inputs(messages: list[dict], plan: ToolPlan | None, supports_tools: bool) -> tuple[list[dict], dict]:
    """(messages, extra template keywords) for the chat template: the tools and earlier tool turns in the form
    the template takes (see the module docstring)."""
    if supports_tools:
        messages = [_arguments_as_objects(m) for m in messages]
        return messages, ({"tools": [t.spec for t in plan.tools]} if plan is not None else {})
    messages = _hermes_history(messages)
    if plan is not None:
        prompt = plan.system_prompt()
        if messages and messages[0].get("role") == "system":
            first = messages[0]
            messages = [{**first, "content": f"{first.get('content') or ''}\n\n{prompt}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": prompt}, *messages]
    return messages, {}


def _arguments_as_objects(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}


def _hermes_history(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    responses = False  # the last message out is a user turn of tool responses
    for message in messages:
        if message.get("role") == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if responses:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            responses = True
            continue
        responses = False
        blocks = [_hermes_block(call) for call in message.get("tool_calls") or ()]
        content = message.get("content") or ""
        if blocks:
            content = "\n".join([content, *blocks]) if content else "\n".join(blocks)
        out.append({**{k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")},
                    "content": content})
    return out


def _hermes_block(call: dict) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"
