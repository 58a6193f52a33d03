"""A Realtime session's functions: its ``tools`` checked (``check_session_tools``), shown to the
model in the chat-completions shape (``shown_tools``), and the grammar its ``tool_choice`` holds
the replies to (``tools_grammar``)."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from modalities.llm.structured import reply_grammar
from modalities.llm.tools import MAX_TOOLS, ToolError, check_function
from modalities.llm.tools import check_template as tools_template
from pipelines.realtime_events import EventError

if TYPE_CHECKING:
    from pipelines.realtime_config import SessionConfig


def check_session_tools(tools: Any) -> list[dict[str, Any]]:
    """A session's ``tools``: ``{"type": "function", "name", "description", "parameters"}`` each."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise EventError(f"tools must be a list of at most {MAX_TOOLS} functions", param="session.tools")
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise EventError(
                "each tool must be {'type': 'function', 'name': str, 'description': str, 'parameters': {...}}",
                param=f"session.tools[{k}]",
            )
        try:
            check_function(tool, f"session.tools[{k}]")
        except ToolError as exc:
            raise EventError(str(exc), param=exc.param) from None
    return tools


def shown_tools(config: SessionConfig) -> list[dict[str, Any]] | None:
    """The tools the model is shown, chat-shaped (None: none, or ``tool_choice`` "none")."""
    return chat_tools(config.tools) if config.tools and config.tool_choice != "none" else None


def tools_grammar(tokenizer: Any, config: SessionConfig) -> str | None:
    """What ``config``'s ``tool_choice`` holds replies to ("required", a named function; None:
    free text). Checks what ``SessionConfig.update`` cannot alone: a chat template that renders
    the tools, a named function among them (calls asked for with no tools are refused),
    parameters that compile."""
    tools = shown_tools(config)
    if tools is None and config.tool_choice not in ("auto", "none"):  # (a call it could not make)
        raise EventError(f"tool_choice {config.tool_choice!r} needs tools: none are given", param="session.tool_choice")
    if tools is None:
        return None
    try:
        tools_template(tokenizer, "session.tools")
        return _grammar(json.dumps(tools), json.dumps(config.tool_choice))
    except ToolError as exc:
        raise EventError(str(exc), param=exc.param) from None


@functools.lru_cache(maxsize=64)
def _grammar(tools: str, tool_choice: str) -> str | None:
    """``reply_grammar`` of JSON-encoded tools and choice, once per pair: a session compiles
    them at each ``session.update`` and per ``response.create`` that sets its own."""
    return reply_grammar(None, json.loads(tools), json.loads(tool_choice), where="session.")


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Realtime's tools in the chat-completions shape the chat templates take."""
    keys = ("name", "description", "parameters")
    return [{"type": "function", "function": {k: t[k] for k in keys if k in t}} for t in tools]
