"""Conversation items on the Realtime wire: a client's items (text messages, function calls and
their outputs, references) read into ``Item`` fields, and items and responses (``Reply``'s
book-keeping) written as Realtime objects."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipelines.conversation import Conversation, Item, Spoken
from pipelines.frames import ResponseRequest
from pipelines.realtime_config import SessionConfig
from pipelines.realtime_events import EventError, item_id_of


def message_text(item: Any, where: str = "item") -> tuple[str, str]:
    """``(role, text)`` of a text message (``conversation.item.create``'s item, or one of
    ``response.input``'s at ``where``)."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise EventError("items are of type 'message', 'function_call' or 'function_call_output'", param=where)
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise EventError(f"{where}.role must be 'user', 'assistant' or 'system'", param=f"{where}.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise EventError(f"{where}.content must be a non-empty list", param=f"{where}.content")
    texts = []
    kinds = ("input_text", "text", "output_text") if role == "assistant" else ("input_text", "text")
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            raise EventError(
                f"{where}.content parts must be {{'type': one of {list(kinds)}, 'text': str}}",
                param=f"{where}.content",
            )
        texts.append(part["text"])
    return role, " ".join(texts)


def client_item(raw: Any, where: str = "item") -> tuple[str, str, dict[str, Any]]:
    """(role, text, other ``Item`` fields) of a client's message, function call or output."""
    if isinstance(raw, dict) and raw.get("type") in ("function_call", "function_call_output"):
        fields: dict[str, Any] = function_item(raw, where)
        return "assistant" if fields["kind"] == "function_call" else "tool", fields.pop("text"), fields
    return *message_text(raw, where), {}


def response_items(raw: Any, conv: Conversation) -> list[Item] | None:
    """``response.input`` as the items to render: text messages, function calls and outputs,
    and references to ``conv``'s items (``{"type": "item_reference", "id": ...}``)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise EventError("response.input must be a list of items", param="response.input")
    out = []
    for k, entry in enumerate(raw):
        where = f"response.input[{k}]"
        if isinstance(entry, dict) and entry.get("type") == "item_reference":
            item = conv.get(entry.get("id")) if isinstance(entry.get("id"), str) else None
            if item is None:
                raise EventError(f"no item {entry.get('id')!r} in the conversation", "item_not_found", where + ".id")
            out.append(item if item.pending else dataclasses.replace(item))  # (pending: heard before the reply renders)
        else:
            role, text, fields = client_item(entry, where)
            out.append(Item("", role, text, **fields))
    return out


def function_item(item: dict[str, Any], where: str = "item") -> dict[str, str]:
    """A client's ``function_call`` (``call_id``, ``name``, ``arguments``) or
    ``function_call_output`` (``call_id``, ``output``) item as ``Item`` fields."""
    kind = item["type"]
    keys = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
    for key in keys:
        if not isinstance(item.get(key), str) or (key != "output" and not item[key]):
            raise EventError(f"a {kind} item needs a string {key}", param=f"{where}.{key}")
    text = item["arguments"] if kind == "function_call" else item["output"]
    return {"kind": kind, "call_id": item["call_id"], "name": item.get("name", ""), "text": text}


def function_item_event(item: Item, status: str = "completed") -> dict[str, Any]:
    """A function call or its output as a Realtime item."""
    out = {"id": item.id, "object": "realtime.item", "type": item.kind, "status": status, "call_id": item.call_id}
    if item.kind == "function_call":
        return {**out, "name": item.name, "arguments": item.text}
    return {**out, "output": item.text}


def content_part(role: str, audio: bool, text: str | None) -> dict[str, Any]:
    """A message item's content part: the user's ``input_audio`` (its transcript) or
    ``input_text``, the assistant's ``audio`` (its transcript) or ``text``."""
    if role == "assistant":
        return {"type": "audio", "transcript": text} if audio else {"type": "text", "text": text}
    return {"type": "input_audio", "transcript": text} if audio else {"type": "input_text", "text": text}


def item_event(item_id: str, role: str, content: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": content,
    }


@dataclass
class Reply:
    """Book-keeping of one response for events, truncation and usage."""

    id: str
    item_id: str
    audio: bool
    text: str = ""
    spoken: list[Spoken] = field(default_factory=list)
    audio_ms: float = 0.0
    heard_ms: float | None = None  # once the client truncated it: the audio it kept (a truncation only shortens)
    first_audio: float | None = None  # monotonic time the first audio delta was sent
    done: bool = False
    usage: dict[str, Any] = field(default_factory=dict)
    out_of_band: bool = False  # response.conversation "none": its item is not in the conversation
    conversation_id: str | None = None  # the session's conversation (None: out of band)
    metadata: dict[str, Any] | None = None  # response.metadata, echoed
    audio_format: str = "pcm16"  # its audio's wire format (``pipelines.realtime_audio.FORMATS``)
    # Its settings as its response object shows them (``response_settings``).
    voice: str | None = None
    temperature: float = SessionConfig.temperature
    max_output_tokens: int | str = SessionConfig.max_response_output_tokens
    calls: list[dict[str, Any]] = field(default_factory=list)  # its function_call items, after its message
    # Its message item: announced (with tools on, only at its first text or audio, so that a
    # reply that only calls a function has no message) and done (before a call's item is added).
    opened: bool = False
    message: dict[str, Any] | None = None
    cut: bool = False  # its text ended at max_output_tokens: the response is "incomplete"
    # The call being written: its event fields (response_id, output_index, item_id, call_id) and item.
    writing: tuple[dict[str, Any], dict[str, Any]] | None = None
    event_id: str | None = None  # the client's response.create that asked for it, if any
    error: dict[str, Any] | None = None  # why it failed (OpenAI's status_details.error)
    # Settles the tenant's charge for it to the tokens it used (``LLMReserved``; None: not charged)
    settle: Callable[[float], Awaitable[None]] | None = None

    def played_ms(self) -> float:
        """How much the client can have played: real-time clock since the first chunk, capped
        (by its own truncation too, once it made one)."""
        if self.first_audio is None:
            return 0.0
        played = min(self.audio_ms, (time.monotonic() - self.first_audio) * 1000.0)
        return played if self.heard_ms is None else min(played, self.heard_ms)

    def playing(self) -> bool:
        """Whether its audio may still be playing: not once the client truncated it (it stopped there)."""
        return self.audio and self.heard_ms is None and self.played_ms() < self.audio_ms


def response_settings(config: SessionConfig, asked: ResponseRequest | None) -> dict[str, Any]:
    """A reply's ``Reply`` fields ``voice``, ``temperature`` and ``max_output_tokens``: those its
    ``response.create`` (``asked``; None: a turn's own reply) set, else the session's."""
    if asked is None:
        asked = ResponseRequest()
    return {
        "voice": config.voice if asked.voice is None else asked.voice,
        "temperature": config.temperature if asked.temperature is None else asked.temperature,
        "max_output_tokens": (
            config.max_response_output_tokens if asked.max_output_tokens is None else asked.max_output_tokens
        ),
    }


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """A response's ``usage`` (text tokens only: the audio is spoken from the text)."""
    return {
        "total_tokens": prompt_tokens + completion_tokens,
        "input_tokens": prompt_tokens,
        "output_tokens": completion_tokens,
        "input_token_details": {"cached_tokens": cached_tokens, "text_tokens": prompt_tokens, "audio_tokens": 0},
        "output_token_details": {"text_tokens": completion_tokens, "audio_tokens": 0},
    }


def response_event(r: Reply, status: str, output: list[dict[str, Any]], reason: str | None = None) -> dict[str, Any]:
    """Reply ``r``'s ``realtime.response`` object (beta shape), ``status`` for ``reason``."""
    details: dict[str, Any] | None = {"type": status, "reason": reason} if reason else None
    if status == "failed":  # (OpenAI's: no reason, the error's type and code)
        details = {"type": status, "error": None if r.error is None else {k: r.error[k] for k in ("type", "code")}}
    return {
        "id": r.id,
        "object": "realtime.response",
        "conversation_id": r.conversation_id,
        "status": status,
        "status_details": details,
        "output": output,
        # The settings it ran with, in the beta shape (``realtime_ga.response_object`` makes GA's).
        "modalities": ["text", "audio"] if r.audio else ["text"],
        "voice": r.voice,
        "output_audio_format": r.audio_format,
        "temperature": r.temperature,
        "max_output_tokens": r.max_output_tokens,
        "usage": r.usage or None,
        "metadata": r.metadata,
    }


# The replies whose items a client may truncate (one playing behind the latest).
MAX_TRUNCATABLE = 16


def truncation(event: dict[str, Any], conv: Conversation, replies: dict[str, Reply]) -> tuple[Reply, int]:
    """A ``conversation.item.truncate``'s reply (one of ``replies``, by item id: the latest ones)
    and ``audio_end_ms``, checked: the item is in ``conv``, the audio end within what the reply
    sent (and, once the client truncated it, within that)."""
    item_id, end_ms = item_id_of(event), event.get("audio_end_ms")
    if event.get("content_index", 0) != 0 or isinstance(event.get("content_index"), bool | float):
        raise EventError("content_index must be 0: an assistant item has one content part", param="content_index")
    if (item := conv.get(item_id)) is None:
        raise EventError(f"there is no item {item_id!r} in the conversation", code="item_not_found", param="item_id")
    reply = replies.get(item.id)
    if reply is None and (item.role != "assistant" or item.kind != "message"):
        raise EventError(f"item {item.id!r} is not an assistant message: it has no audio", param="item_id")
    if reply is None:  # (or the client's own)
        raise EventError(
            f"item {item.id!r} is not one of the last {MAX_TRUNCATABLE} replies: it cannot be truncated",
            param="item_id",
        )
    if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
        raise EventError("audio_end_ms must be a non-negative integer", param="audio_end_ms")
    kept = reply.audio_ms if reply.heard_ms is None else min(reply.audio_ms, reply.heard_ms)
    if end_ms > kept + 1:
        what = "audio" if reply.heard_ms is None else "audio, truncated"
        raise EventError(f"audio_end_ms {end_ms} is past the item's {what} ({kept:.0f} ms)", param="audio_end_ms")
    return reply, end_ms
