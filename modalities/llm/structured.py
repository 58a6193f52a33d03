"""What a reply's tokens are held to (``engine.structured``): ``response_format`` and
``tool_choice`` as one grammar (shared by ``/v1/chat/completions`` and the realtime sessions),
or vLLM's guided decoding fields."""

from __future__ import annotations

import json
from typing import Any

from engine.structured import (
    GrammarError,
    cfg_grammar,
    check_grammar,
    choice_grammar,
    json_grammar,
    lark_grammar,
    lark_json,
    regex_grammar,
)
from modalities.llm.tools import ToolError, call_grammar


def _checked(grammar: str, param: str) -> str:
    try:
        check_grammar(grammar)
    except GrammarError as exc:
        # (its first line: the rest quotes the grammar mmserve built around the schema)
        message = str(exc).splitlines()[0].split(": ", 1)[-1] if str(exc).startswith("at ") else str(exc)
        raise ToolError(f"{param} does not compile to a grammar: {message}", param) from exc
    return grammar


def reply_grammar(
    schema: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel: bool = True,
    where: str = "",
) -> str | None:
    """The grammar of a reply (None: free text), from checked chat-shaped ``tools``:
    - ``tool_choice`` "required" or a named function: one or more calls (one: not ``parallel``);
    - a JSON ``schema`` (``response_format``): JSON valid under it, or, with tools on "auto",
      either that or calls, as OpenAI's models may answer either way.
    ``ToolError`` (naming ``where`` + the param) when a schema does not compile."""
    reply = None if schema is None else _checked(json_grammar(schema), where + "response_format")
    calls = call_grammar(tools, tool_choice, parallel, where) if tools and tool_choice != "none" else None
    if calls is not None:
        return _checked(lark_grammar(f"start: calls\n{calls}"), where + "tools")
    if reply is not None and tools and tool_choice in (None, "auto"):
        calls = call_grammar(tools, "required", parallel, where)
        return _checked(lark_grammar(f"start: calls | reply\nreply: {lark_json(schema)}\n{calls}"), where + "tools")
    return reply


def guided_grammar(kind: str, value: Any, param: str) -> str:
    """The grammar of vLLM's guided decoding (``guided_json``, ``guided_regex``, ``guided_choice``,
    ``guided_grammar``, or the same under ``structured_outputs``); ``ToolError`` naming ``param``
    when it is malformed or does not compile."""
    if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise ToolError("choice must be a non-empty list of non-empty strings", param)
    build = {"json": json_grammar, "choice": choice_grammar, "regex": regex_grammar, "grammar": cfg_grammar}[kind]
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ToolError(f"{param} is not JSON: {exc}", param) from exc
    if kind == "json" and not isinstance(value, dict):
        raise ToolError("a JSON schema must be an object", param)
    try:
        grammar = build(value)
    except ValueError as exc:  # (a GBNF text that does not convert)
        raise ToolError(f"{param} does not compile to a grammar: {exc}", param) from exc
    return _checked(grammar, param)
