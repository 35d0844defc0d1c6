"""The model's text -> OpenAI tool calls, as it streams or all at once (one parser per choice).

Three shapes of output, one per ``tool_choice`` (``tool_calls`` builds the prompt and the schema):

* ``auto``: free text with Hermes blocks (Qwen's templates, vLLM's ``--tool-call-parser hermes``)::

      Let me check.<tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  Text outside the blocks is the message's ``content``. ``HermesParser`` holds back text that may be the
  start of ``<tool_call>``; once a block's head ``{"name": "...", "arguments":`` has arrived it emits the
  call (index, id, name) and then streams the raw text of the arguments, holding back what may be the
  object's closing ``}`` and the start of ``</tool_call>``. A block in another order (``arguments`` first)
  is parsed when it closes; a block that is not a JSON object with a ``name`` stays in the content as text.
  Whitespace around blocks is dropped; a reply without blocks is its text unchanged.
* ``required``: the JSON array ``[{"name": ..., "arguments": {...}}, ...]`` the schema enforces;
  ``JsonArrayParser`` streams each call as Hermes blocks are streamed: the call once its object's head
  ``{"name": "...", "arguments":`` has arrived, then the raw text of its arguments (an object in another
  order is emitted when it is complete, its arguments serialised).
* a named function: the output is that function's arguments (``ArgumentsParser``), streamed as they come.

``feed`` returns what a chunk of text added; ``finish`` what is left when the output ends (an unclosed
block is read as if it closed there). Feeding the whole text at once, then ``finish``, gives the
non-streaming answer, so a stream split anywhere adds up to the same content and calls.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """Part of tool call ``index``: its first part has ``id`` and ``name``, later parts more ``arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_chunk(self) -> dict:
        """The ``delta.tool_calls[]`` entry OpenAI streams."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    """What some text added: content, and parts of calls (parts of one call merged)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        self.content += other.content
        for part in other.calls:
            self.call(part)
        return self

    def call(self, part: CallDelta) -> None:
        if self.calls and self.calls[-1].index == part.index:
            self.calls[-1].arguments += part.arguments
        elif part.id is not None or part.arguments:
            self.calls.append(part)


class ToolCallParser(ABC):
    """One choice's output, fed as it streams; ``calls`` counts the tool calls begun so far."""

    def __init__(self) -> None:
        self.calls = 0
        # The call object being streamed (``_stream_object``): its call index once its head arrived, and where
        # its arguments start and how far they were sent, as offsets into the object's text.
        self._call: int | None = None
        self._args_start = 0
        self._args_sent = 0

    @abstractmethod
    def feed(self, text: str) -> Parsed: ...

    @abstractmethod
    def finish(self) -> Parsed: ...

    def _begin(self, out: Parsed, name: str, arguments: str = "") -> int:
        index = self.calls
        self.calls += 1
        out.call(CallDelta(index, new_call_id(), name, arguments))
        return index

    def _stream_object(self, out: Parsed, region: str) -> None:
        """``region``: a call object's text so far (``{"name": "...", "arguments": ...``): begin the call once its
        head has arrived, then send the arguments' raw text, holding back what may be the object's closing
        ``}`` (and the start of ``</tool_call>``). An object whose head is in another order sends nothing here."""
        if self._call is None:
            head = _HEAD.match(region)
            if head is None:
                return  # not (yet) an object this parser can stream: read it whole when it closes
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return
            self._call = self._begin(out, name)
            self._args_start, self._args_sent = head.end(), head.end()
        if self._args_sent == self._args_start:  # whitespace before the arguments is not theirs
            while self._args_start < len(region) and region[self._args_start].isspace():
                self._args_start += 1
            self._args_sent = self._args_start
        end = self._args_start + _args_end(region[self._args_start:], closed=False)
        if end > self._args_sent:
            out.call(CallDelta(self._call, arguments=region[self._args_sent:end]))
            self._args_sent = end

    def _close_object(self, out: Parsed, region: str) -> bool:
        """The call object ``region`` is whole: send the rest of its streamed arguments. False if it was not
        streamed (its head is in another order): the caller parses it."""
        self._stream_object(out, region)
        if self._call is None:
            return False
        end = self._args_start + _args_end(region[self._args_start:], closed=True)
        if end > self._args_sent:
            out.call(CallDelta(self._call, arguments=region[self._args_sent:end]))
        self._call = None
        return True


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict]]:
    """A whole output -> (``message.content``, ``message.tool_calls``); content is None when there are calls
    and no text."""
    parsed = parser.feed(text).add(parser.finish())
    calls: list[dict] = []
    for part in parsed.calls:
        if part.id is not None:
            calls.append({"id": part.id, "type": "function",
                          "function": {"name": part.name, "arguments": part.arguments}})
        else:
            calls[part.index]["function"]["arguments"] += part.arguments
    content = parsed.content if parsed.content or not calls else None
    return content, calls


def _arguments_text(obj: dict) -> str | None:
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return args
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _args_end(region: str, closed: bool) -> int:
    """Where a block's arguments text ends: before the outer object's ``}`` (and whitespace around it) and,
    while the block is open, before what may be the start of ``</tool_call>``."""
    end = len(region) - (0 if closed else _partial_suffix(region, CLOSE))
    rest = region[:end].rstrip()
    if rest.endswith("}"):
        rest = rest[:-1].rstrip()
    return len(rest)


class HermesParser(ToolCallParser):
    """``tool_choice="auto"``: content with ``<tool_call>`` blocks (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text not yet consumed: a possible start of OPEN, or the open block's region
        self._in_block = False
        self._space = ""  # content whitespace held back (dropped before a call and after the last one)
        self._after_call = False
        self._space_before_block = ""

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while True:
            if not self._in_block:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    self._content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(out, self._buf[:at])
                self._space_before_block, self._space = self._space, ""
                self._buf = self._buf[at + len(OPEN):]
                self._in_block, self._call = True, None
            else:
                at = self._buf.find(CLOSE)
                if at < 0:
                    self._stream_object(out, self._buf)
                    return out
                self._close_block(out, self._buf[:at], CLOSE)
                self._buf = self._buf[at + len(CLOSE):]

    def finish(self) -> Parsed:
        out = Parsed()
        if self._in_block:
            self._close_block(out, self._buf, "")
        else:
            self._content(out, self._buf)
        self._buf = ""
        if not self.calls:
            out.content += self._space
        self._space = ""
        return out

    def _content(self, out: Parsed, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        pending = self._space + text
        kept = pending.rstrip()
        out.content += kept
        self._space = pending[len(kept):]

    def _close_block(self, out: Parsed, region: str, close: str) -> None:
        self._in_block = False
        if self._close_object(out, region):
            self._after_call = True
            return
        try:
            obj = json.loads(region)
        except ValueError:
            obj = None
        arguments = _arguments_text(obj) if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None
        if arguments is None:  # not a call: the block stays in the content, as the model wrote it
            self._space = self._space_before_block
            self._content(out, OPEN + region + close)
            return
        self._begin(out, obj["name"], arguments)
        self._after_call = True


class JsonArrayParser(ToolCallParser):
    """``tool_choice="required"``: ``[{"name": ..., "arguments": {...}}, ...]``, each call streamed as its object
    arrives (the module docstring). Output that is not such an array (no call in it) is returned as content."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._pos: int | None = None  # just past '[' once seen
        self._failed = False

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        if self._failed:
            return out
        if self._pos is None:
            start = self._buf.lstrip()
            if not start:
                return out
            if not start.startswith("["):
                self._failed = True
                return out
            self._pos = len(self._buf) - len(start) + 1
        while True:
            pos = self._pos
            while pos < len(self._buf) and (self._buf[pos].isspace() or self._buf[pos] == ","):
                pos += 1
            if pos >= len(self._buf) or self._buf[pos] == "]":
                return out
            self._pos = pos  # the object's start, until it is whole
            try:
                obj, end = _DECODER.raw_decode(self._buf, pos)
            except ValueError:  # incomplete (or malformed: then finish tells)
                if self._buf[pos] == "{":
                    self._stream_object(out, self._buf[pos:])
                return out
            if self._close_object(out, self._buf[pos:end]):
                self._pos = end
                continue
            arguments = _arguments_text(obj) if isinstance(obj, dict) and isinstance(obj.get("name"), str) \
                else None
            if arguments is None:
                self._failed = True
                return out
            self._begin(out, obj["name"], arguments)
            self._pos = end

    def finish(self) -> Parsed:
        if not self.calls:
            return Parsed(content=self._buf)
        out = Parsed()
        if self._call is not None and self._pos is not None:  # cut short inside an object: read as if it closed
            self._close_object(out, self._buf[self._pos:])
        return out


class ArgumentsParser(ToolCallParser):
    """A named ``tool_choice``: the whole output is that function's arguments, streamed (whitespace around
    them dropped)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._space = ""
        self._started = False

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if not self.calls:
            self._begin(out, self.name)
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        pending = self._space + text
        kept = pending.rstrip()
        self._space = pending[len(kept):]
        if kept:
            out.call(CallDelta(0, arguments=kept))
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if not self.calls:
            self._begin(out, self.name)
        return out
