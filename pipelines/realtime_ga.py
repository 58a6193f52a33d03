"""OpenAI's Realtime GA dialect, as a translation at the edge of the beta one a session speaks.

A ``/v1/realtime`` client that does not ask for beta (the ``OpenAI-Beta: realtime=v1`` header or
the ``openai-beta.realtime-v1`` subprotocol) speaks GA from its first event, as with OpenAI (the
official ``openai`` SDK's ``client.realtime.connect`` does); a beta client switches to GA with a
``session.update`` whose ``session.type`` is "realtime". In GA, client session objects are read
in the GA shape (``output_modalities``, ``audio.input.format``, ``audio.input.turn_detection``,
``audio.output.voice``, ``max_output_tokens``) and every server event leaves translated: the
output events renamed (``response.output_audio.delta``, ...), ``conversation.item.added`` then
``conversation.item.done`` for items, an assistant item's content as ``output_text`` /
``output_audio`` (a ``response.content_part.*`` part keeps ``text`` / ``audio``, as in GA), and
the session and response objects in the GA shape. A beta-only client event (``BETA_EVENTS``) is
refused, as OpenAI's GA server refuses it.
"""

from __future__ import annotations

import re
from typing import Any

from pipelines.realtime_audio import FORMATS
from pipelines.realtime_events import EventError, unknown_parameter
from pipelines.realtime_fields import ga_wire_format, wants_audio

RENAMED = {
    "response.text.delta": "response.output_text.delta",
    "response.text.done": "response.output_text.done",
    "response.audio.delta": "response.output_audio.delta",
    "response.audio.done": "response.output_audio.done",
    "response.audio_transcript.delta": "response.output_audio_transcript.delta",
    "response.audio_transcript.done": "response.output_audio_transcript.done",
    "conversation.item.created": "conversation.item.added",
}
PART_TYPES = {"text": "output_text", "audio": "output_audio"}


# Client events of the beta protocol only, with GA's way to do the same: OpenAI's GA server
# refuses them ("Invalid value"), and so does a GA session here.
BETA_EVENTS = {
    "transcription_session.update": (
        "a GA transcription session (/v1/realtime?intent=transcription) takes a session.update "
        "with session.type 'transcription'"
    )
}


def beta_event(kind: str) -> EventError:
    """The error for beta-only client event ``kind`` (one of ``BETA_EVENTS``) in a GA session."""
    return EventError(f"Invalid value: '{kind}': a GA session has no such event; {BETA_EVENTS[kind]}", param="type")


def is_ga(session: Any) -> bool:
    """Whether a ``session.update``'s session object is in the GA shape."""
    kind = session.get("type") if isinstance(session, dict) else None
    if kind not in (None, "realtime"):
        raise EventError(f"session.type must be 'realtime', got {kind!r}", param="session.type")
    return kind == "realtime"


# Beta parameter paths in ``SessionConfig.update``'s errors -> the GA field a client sent.
GA_PARAMS = {
    "session.modalities": "session.output_modalities",
    "session.max_response_output_tokens": "session.max_output_tokens",
    "session.turn_detection": "session.audio.input.turn_detection",
    "session.voice": "session.audio.output.voice",
    "session.speed": "session.audio.output.speed",
    "session.input_audio_transcription": "session.audio.input.transcription",
    "session.input_audio_noise_reduction": "session.audio.input.noise_reduction",
}


def ga_param(param: str | None) -> str | None:
    """The GA path of a beta ``session`` parameter path (unchanged if it has none)."""
    for beta, ga in GA_PARAMS.items():
        if param is not None and (param == beta or param.startswith(beta + ".")):
            return ga + param[len(beta) :]
    return param


# A beta field's name where an error message names it (not inside another name or path).
_BETA_NAMES = re.compile(r"(?<![\w.])(session\.)?(" + "|".join(b.removeprefix("session.") for b in GA_PARAMS) + r")\b")


class FieldError(EventError):
    """A field a GA session does not have, named as the client sent it (``ga_error`` keeps it)."""


# A GA session's fields (OpenAI's session create requests), with those of the object the server
# sends (a client may send that back whole) and mmserve's ``temperature``: closed sets, so that a
# beta field in a GA session.update is refused, not ignored unseen.
_ECHOED = ("object", "id", "expires_at")
REALTIME_FIELDS = frozenset(
    ("type", "audio", "include", "instructions", "max_output_tokens", "model", "output_modalities", "prompt")
    + ("parallel_tool_calls", "reasoning", "tool_choice", "tools", "tracing", "truncation", "temperature")
    + _ECHOED
)
TRANSCRIPTION_FIELDS = frozenset(("type", "audio", "include") + _ECHOED)
# Beta session fields the GA shape moved, where it has them.
MOVED = {
    **{beta.removeprefix("session."): ga for beta, ga in GA_PARAMS.items()},
    "input_audio_format": "session.audio.input.format",
    "output_audio_format": "session.audio.output.format",
}


def check_fields(session: dict[str, Any], fields: frozenset[str]) -> None:
    """A ``FieldError`` for the first of ``session``'s fields not in ``fields``; a beta field's
    message says where the GA shape has it."""
    if unknown := sorted(set(session) - fields):
        key = unknown[0]
        where = f": a GA session has it as {MOVED[key]}" if key in MOVED else ""
        raise unknown_parameter(f"session.{key}", where, FieldError)


def ga_error(exc: EventError) -> EventError:
    """A ``session.update`` error in the GA client's terms: its param and the fields its message
    names (a ``FieldError`` already is)."""
    if isinstance(exc, FieldError):
        return exc
    message = _BETA_NAMES.sub(lambda m: (m[1] or "") + GA_PARAMS["session." + m[2]].removeprefix("session."), str(exc))
    return EventError(message, exc.code, ga_param(exc.param), exc.event_id)


# The fields of a GA ``audio`` object, by side: a closed set (a misplaced field, e.g. ``include``,
# would otherwise do nothing unseen).
SESSION_AUDIO = {
    "input": frozenset(("format", "transcription", "turn_detection", "noise_reduction")),
    "output": frozenset(("format", "voice", "speed")),
}
RESPONSE_AUDIO = {"output": frozenset(("format", "voice"))}  # (a response's own output only)


def ga_audio(value: Any, param: str, fields: dict[str, frozenset[str]]) -> dict[str, dict[str, Any]]:
    """The sides of a GA ``audio`` object at ``param`` (``session.audio``, ``response.audio``),
    each an object ({} when left out or null) holding none but its ``fields``; an ``EventError``
    names what is not so (an unknown field: ``unknown_parameter``, as the session's own)."""
    name = param.removeprefix("session.")
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise EventError(f"{name} must be an object", param=param)
    if unknown := sorted(set(value) - set(fields)):
        raise unknown_parameter(f"{param}.{unknown[0]}", error=FieldError)
    sides = {}
    for side, known in fields.items():
        conf = {} if value.get(side) is None else value[side]
        if not isinstance(conf, dict):
            raise EventError(f"{name}.{side} must be an object", param=f"{param}.{side}")
        if unknown := sorted(set(conf) - known):
            raise unknown_parameter(f"{param}.{side}.{unknown[0]}", error=FieldError)
        sides[side] = conf
    return sides


def session_patch(ga: dict[str, Any]) -> dict[str, Any]:
    """The beta ``session`` patch for a GA one: the fields mmserve honours (the other GA fields are
    ignored; a field a GA session, ``audio``, ``audio.input`` or ``audio.output`` does not have
    is refused)."""
    check_fields(ga, REALTIME_FIELDS)
    out = {k: ga[k] for k in ("model", "instructions", "temperature", "tools", "tool_choice", "include") if k in ga}
    if "output_modalities" in ga:
        audio_out = wants_audio(ga["output_modalities"], True, "session.output_modalities")
        out["modalities"] = ["text", "audio"] if audio_out else ["text"]  # audio comes with its transcript
    if "max_output_tokens" in ga:
        out["max_response_output_tokens"] = ga["max_output_tokens"]
    sides = ga_audio(ga.get("audio"), "session.audio", SESSION_AUDIO)
    for side, conf in sides.items():
        if conf.get("format") is not None:
            out[f"{side}_audio_format"] = ga_wire_format(conf["format"], f"session.audio.{side}.format")
    if "turn_detection" in sides["input"]:
        out["turn_detection"] = sides["input"]["turn_detection"]
    for key in ("voice", "speed"):
        if key in sides["output"]:
            out[key] = sides["output"][key]
    if "transcription" in sides["input"]:
        out["input_audio_transcription"] = sides["input"]["transcription"]
    if "noise_reduction" in sides["input"]:
        out["input_audio_noise_reduction"] = sides["input"]["noise_reduction"]
    return out


def session_object(beta: dict[str, Any]) -> dict[str, Any]:
    """The GA session object of a beta one (``SessionConfig.to_dict``)."""
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": beta["id"],
        "model": beta["model"],
        "output_modalities": ["audio"] if "audio" in beta["modalities"] else ["text"],
        "instructions": beta["instructions"],
        "audio": {
            "input": {
                "format": dict(FORMATS[beta["input_audio_format"]].ga),
                "transcription": beta["input_audio_transcription"],
                "turn_detection": beta["turn_detection"],
                "noise_reduction": beta["input_audio_noise_reduction"],
            },
            "output": {
                "format": dict(FORMATS[beta["output_audio_format"]].ga),
                "voice": beta["voice"],
                "speed": beta["speed"],
            },
        },
        "tools": beta["tools"],
        "tool_choice": beta["tool_choice"],
        "max_output_tokens": beta["max_response_output_tokens"],
        "include": beta["include"],
    }


# A beta response object's fields that GA has in another shape, or not at all (``temperature``).
_BETA_RESPONSE = frozenset(("modalities", "voice", "output_audio_format", "temperature"))


def response_object(beta: dict[str, Any]) -> dict[str, Any]:
    """The GA response object of a beta one (``realtime_items.response_event``): its output in
    the GA shape, ``output_modalities`` and ``audio.output`` (its format and voice)."""
    out = {k: v for k, v in beta.items() if k not in _BETA_RESPONSE}
    out["output"] = [_item(i) for i in beta["output"]]
    out["output_modalities"] = ["audio"] if "audio" in beta["modalities"] else ["text"]
    out["audio"] = {"output": {"format": dict(FORMATS[beta["output_audio_format"]].ga), "voice": beta["voice"]}}
    return out


def _item(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("role") != "assistant":
        return item
    return {**item, "content": [_part(p) for p in item.get("content", [])]}


def _part(part: dict[str, Any]) -> dict[str, Any]:
    return {**part, "type": PART_TYPES.get(part["type"], part["type"])}


def translate(event: dict[str, Any], in_conversation: bool = True) -> list[dict[str, Any]]:
    """The GA events (one, or two for an item) for a beta server event, without event ids;
    ``in_conversation`` False: the event's item is not in the conversation (an out-of-band
    reply's), so no ``conversation.item.done`` follows it."""
    out = {**event, "type": RENAMED.get(event["type"], event["type"])}
    if "session" in out and out["session"]["object"] == "realtime.session":  # (a transcription one is GA already)
        out["session"] = session_object(out["session"])
    if "item" in out:
        out["item"] = _item(out["item"])
    if "response" in out:
        out["response"] = response_object(out["response"])
    done = in_conversation and (
        out["type"] == "response.output_item.done"
        or (out["type"] == "conversation.item.added" and out["item"].get("status") == "completed")
    )
    if done:  # GA says when an item is complete: a user's at once, a reply's when it ends
        return [out, {"type": "conversation.item.done", "item": out["item"]}]
    return [out]
