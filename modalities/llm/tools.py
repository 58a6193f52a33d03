"""Tool calls (OpenAI function calling) in a model's text, in the Hermes format: the chat template
renders the ``tools`` and earlier calls, and the model writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Hermes, and any model
served with such a template via ``--chat-template``).

Shared by ``/v1/chat/completions`` and the realtime sessions: ``check_tools`` validates a
request's ``tools``/``tool_choice``, ``parse_tool_calls`` splits a finished text, and
``ToolCallStream`` does the same as deltas arrive (text that may open a call is held back until
it is clear). A block that opens with a declared function's name and then its arguments is a
call from there on, its arguments the model's text as written (so that they can stream): like
OpenAI's, they may be no valid JSON (cut short by ``max_tokens``, or a small model's slip without
a grammar), and the client checks them. Any other block is a call if it parses as one (its
arguments re-serialised), else it stays text, as vLLM's Hermes parser leaves it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.structured import lark_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# mmserve's ChatML template with tools in this format (``--chat-template`` for SmolLM2 and the like)
CHATML_TOOLS = Path(__file__).parent / "templates" / "chatml_tools.jinja"
MAX_TOOLS = 128  # as OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire form)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders tools and calls in the Hermes format this module parses."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and OPEN in template


def check_tool_choice(tool_choice: Any, param: str) -> None:
    """None, "auto", "none", "required", or a named function: chat's ``{"type": "function",
    "function": {"name": ...}}`` or Realtime's ``{"type": "function", "name": ...}``."""
    forced_function(tool_choice, param)


def forced_function(tool_choice: Any, param: str) -> str | None:
    """The function a named ``tool_choice`` forces (None for the string choices)."""
    if tool_choice in (None, "auto", "none", "required"):
        return None
    fn = tool_choice.get("function", tool_choice) if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise ToolError(
            "tool_choice must be 'auto', 'none', 'required' or a named function: {'type': 'function', "
            "'function': {'name': ...}} (Realtime: {'type': 'function', 'name': ...})",
            param,
        )
    return name


def call_grammar(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool = True, where: str = "") -> str | None:
    """The Lark rule ``calls`` that a reply must be when ``tool_choice`` asks for calls
    ("required": of any of the chat-shaped ``tools``; named: of that one, else ``ToolError``),
    else None. Each call is the ``<tool_call>`` block this module parses, its arguments valid
    under the function's parameters; ``parallel`` False: one call."""
    forced = forced_function(tool_choice, where + "tool_choice")
    if tool_choice != "required" and forced is None:
        return None
    fns = [t["function"] for t in tools if forced is None or t["function"]["name"] == forced]
    if not fns:
        raise ToolError(f"tool_choice names {forced!r}, which is not among the tools", where + "tool_choice")
    shapes = [
        {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fn in fns
    ]
    call = lark_json(shapes[0] if len(shapes) == 1 else {"anyOf": shapes})
    more = ' ("\\n" call)*' if parallel else ""
    return f'calls: call{more}\ncall: "{OPEN}\\n" {call} "\\n{CLOSE}"'


def check_tools(tools: Any, tool_choice: Any, tokenizer: Any, where: str = "") -> bool:
    """Validate a request's ``tools`` and ``tool_choice`` (``where``: the params' prefix); True
    when the reply is to be parsed for calls."""
    check_tool_choice(tool_choice, where + "tool_choice")
    if tools is None:
        if tool_choice is not None:
            raise ToolError("tool_choice is only allowed when tools are given", where + "tool_choice")
        return False
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise ToolError(f"tools must be a list of 1 to {MAX_TOOLS} tools", where + "tools")
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(
                "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}",
                f"{where}tools[{k}]",
            )
        check_function(fn, f"{where}tools[{k}].function")
    if tool_choice == "none":
        return False
    check_template(tokenizer, where + "tools")
    return True


def check_template(tokenizer: Any, param: str) -> None:
    """Tools to show the model need a chat template that renders them as this module parses."""
    if not template_takes_tools(tokenizer):
        raise ToolError(
            "this model's chat template does not render tools in the Hermes <tool_call> format; "
            "serve it with --chat-template pointing at one that does",
            param,
        )


def check_function(fn: dict[str, Any], where: str) -> None:
    """A function's declaration: a name as OpenAI's (letters, digits, _ and -, at most 64), an
    optional string description and an optional JSON-schema object of parameters."""
    if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
        raise ToolError("a function name is 1 to 64 letters, digits, '_' or '-'", where + ".name")
    if not isinstance(fn.get("description", ""), str):
        raise ToolError("a function description is a string", where + ".description")
    if not isinstance(fn.get("parameters", {}), dict):
        raise ToolError("a function's parameters are a JSON schema object", where + ".parameters")


def declared(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    """The names of chat-shaped ``tools``."""
    return frozenset(t["function"]["name"] for t in tools or [])


def _call(block: str, names: frozenset[str] | None = None) -> ToolCall | None:
    """A call: a function (one of ``names`` if given) and arguments that are a JSON object (or
    its text); else None."""
    try:
        obj = json.loads(block)
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except (ValueError, RecursionError):  # (not JSON, or too deep or too long a number for it)
        return None
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not name or not isinstance(args, dict) or (names and name not in names):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _partial(text: str, tag: str) -> int:
    """How many characters ``text`` ends with of ``tag``'s start (a tag it may be cut inside)."""
    return next((n for n in range(len(tag) - 1, 0, -1) if text.endswith(tag[:n])), 0)


def parse_tool_calls(text: str, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
    """A finished reply as (its text outside the calls, the calls of functions in ``names``)."""
    stream = ToolCallStream(names)
    head = stream.feed(text)
    tail, calls = stream.finish()
    return head + tail, calls


# A call that starts with its name, then its arguments object: those arguments can be streamed
# as they are written (the grammar of tool_choice "required"/named writes calls this way).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def _prefixes(*atoms: str) -> re.Pattern[str]:
    """A regex that fully matches the text of any prefix of ``atoms`` in a row."""
    pattern = ""
    for atom in reversed(atoms):
        pattern = f"(?:{atom}{pattern})?"
    return re.compile(pattern)


# What a call's block holds before its name is read (loosely: keys as any lower-case word): a
# reply that ends there was cut short while opening a call, not writing text.
_KEY = (r'\s*"', "[a-z]*", '"', r"\s*:")
_CUT_HEADER = _prefixes(r"\s*", r"\{", *_KEY, r'\s*"', "[A-Za-z0-9_-]*", '"', r"\s*,", *_KEY, r"\s*")


class _ObjectScan:
    """Finds, as text arrives, where a JSON object that starts the text ends (string-aware
    brace matching; the text's validity is not checked). A ``<`` outside a string ends it too,
    unread: no JSON, but maybe the ``</tool_call>`` of a call whose arguments were cut short."""

    def __init__(self) -> None:
        self.end = 0  # characters scanned
        self.done = False  # the object is closed: ``end`` is just past its last brace
        self._depth = 0
        self._in_string = self._escape = False

    def scan(self, text: str) -> None:
        while self.end < len(text) and not self.done:
            ch = text[self.end]
            if ch == "<" and not self._in_string:
                self.done = True
                return
            self.end += 1
            if self._escape:
                self._escape = False
            elif self._in_string:
                self._escape = ch == "\\"
                self._in_string = ch != '"'
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.done = self._depth == 0


class ToolCallStream:
    """Incremental ``parse_tool_calls``: ``feed`` returns the text that is surely no call;
    ``finish`` returns what was held back and the calls. A call that opens with its (declared)
    name and then its arguments is known once its name is read: it joins ``calls`` then, its
    ``arguments`` growing as they are written (``deltas`` reports the growth); such a call stays
    a call, its arguments cut short if the reply is. Any other block is parsed whole once
    closed, and stays text if it is no call (but a block cut short before its name was read is
    dropped). ``whole``: how many of ``calls`` are complete (their blocks closed, or at the
    reply's end their arguments' object). ``text_after_calls`` False: text after the first call
    is dropped (a spoken reply's message ends where it starts calling)."""

    def __init__(self, names: frozenset[str] | None = None, text_after_calls: bool = True) -> None:
        self._buf = ""  # held back: a possible OPEN's start, or an open call's text
        self._open = False
        self._blank = ""  # whitespace-only text held back
        self._args: tuple[int, _ObjectScan] | None = None  # the open call's arguments: (start in _buf, scan)
        self._sent: list[int] = []  # per call, the characters of its arguments ``deltas`` reported
        self._text_after_calls = text_after_calls
        self.names = names  # the functions declared (None: any name)
        self.calls: list[ToolCall] = []
        self.whole = 0

    def feed(self, delta: str) -> str:
        """The text now surely outside any call; whitespace alone waits for more text (between
        two calls, or after the last, it is no message)."""
        text = self._feed(delta)
        if not text.strip():
            self._blank += text
            return ""
        text, self._blank = self._blank + text, ""
        return text

    def deltas(self) -> list[dict[str, Any]]:
        """What the calls gained since the last ``deltas``, as OpenAI's streamed ``tool_calls``:
        a new call whole as far as it is known (``index``, ``id``, ``type``, ``function``), then
        ``{"index": k, "function": {"arguments": more}}``."""
        out: list[dict[str, Any]] = []
        for k, call in enumerate(self.calls):
            if k == len(self._sent):
                self._sent.append(len(call.arguments))
                out.append({"index": k, **call.to_openai()})
            elif len(call.arguments) > self._sent[k]:
                out.append({"index": k, "function": {"arguments": call.arguments[self._sent[k] :]}})
                self._sent[k] = len(call.arguments)
        return out

    def _feed(self, delta: str) -> str:
        self._buf += delta
        out: list[str] = []
        while True:
            if self._open:
                end = self._close()
                if end < 0:
                    return "".join(out)
                block, self._buf, self._open = self._buf[:end], self._buf[end + len(CLOSE) :], False
                if self._args is None and (call := _call(block.strip(), self.names)) is not None:
                    self.calls.append(call)
                elif self._args is None:
                    self._say(out, OPEN + block + CLOSE)  # not a call: it was text
                self._args, self.whole = None, len(self.calls)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                self._say(out, self._buf[:start])
                self._buf, self._open = self._buf[start + len(OPEN) :], True
                continue
            keep = _partial(self._buf, OPEN)
            self._say(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return "".join(out)

    def _say(self, out: list[str], text: str) -> None:
        if self._text_after_calls or not self.calls:
            out.append(text)

    def _close(self, final: bool = False) -> int:
        """Where the open call's block ends (-1: not written yet): at its first CLOSE, or, once
        its name is read, at the first past its arguments (a CLOSE in an argument string is
        text of the arguments). Reads the call's name, then its arguments: all of them when
        ``final``, else holding back a possible start of CLOSE."""
        if self._args is None:
            head = _HEADER.match(self._buf)
            if head is None or (self.names and head[1] not in self.names):
                return self._buf.find(CLOSE)
            self._args = (head.end(), _ObjectScan())
            self.calls.append(ToolCall(head[1], ""))
        start, scan = self._args
        scan.scan(self._buf[start : len(self._buf) - (0 if final else _partial(self._buf, CLOSE))])
        self.calls[-1].arguments = self._buf[start : start + scan.end]
        return self._buf.find(CLOSE, start + scan.end) if scan.done else -1

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: an unclosed call is parsed if its JSON is whole (a model may stop at the end
        of the JSON, or within the closing tag), else it is text (unless its name was read)."""
        text = self._finish()
        return ("" if self.calls and not (self._text_after_calls and text.strip()) else text), self.calls

    def _finish(self) -> str:
        if self._args is not None:
            self._close(final=True)
        rest, self._buf = self._buf, ""
        blank, self._blank = self._blank, ""
        self.whole = len(self.calls)
        if self._open:
            self._open = False
            if self._args is not None:  # whole if its arguments' object closed
                self.whole -= not self._args[1].done
                self._args = None
                return ""
            block = rest.rstrip()
            cut = _partial(block, CLOSE)
            call = _call(block[: len(block) - cut].strip(), self.names)
            if call is None:
                return "" if _CUT_HEADER.fullmatch(rest) else blank + OPEN + rest
            self.calls.append(call)
            self.whole += 1
            rest = ""
        return blank + rest
