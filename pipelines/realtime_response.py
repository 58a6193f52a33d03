"""A ``response.create``'s ``response`` object read into a ``ResponseRequest``: the reply's own
instructions, modalities, limits, voice, output format and tools, each checked as the session's
are (the session's apply where it says nothing)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipelines.conversation import Conversation
from pipelines.frames import ResponseRequest
from pipelines.realtime_audio import FORMATS
from pipelines.realtime_config import SessionConfig
from pipelines.realtime_events import EventError, unknown_parameter
from pipelines.realtime_fields import (
    check_instructions,
    check_max_tokens,
    check_temperature,
    check_voice,
    ga_wire_format,
    reply_tokens,
    wants_audio,
    wire_format,
)
from pipelines.realtime_ga import MOVED, RESPONSE_AUDIO, ga_audio
from pipelines.realtime_items import response_items
from pipelines.realtime_tools import shown_tools, tools_grammar
from pipelines.services import Services


def response_request(
    response: Any, ga: bool, config: SessionConfig, services: Services, conv: Conversation
) -> ResponseRequest:
    """The request for ``response`` (beta or ``ga`` shape); an ``EventError`` names what is wrong."""
    response = {} if response is None else response
    if not isinstance(response, dict):
        raise EventError("response must be an object", param="response")
    _check_fields(response, ga)
    instructions = response.get("instructions")
    if instructions is not None:
        check_instructions(instructions, "response.instructions")
    key = "output_modalities" if ga else "modalities"
    audio = None if response.get(key) is None else wants_audio(response[key], ga, f"response.{key}")
    conversation = response.get("conversation", "auto")
    if conversation not in ("auto", "none"):
        raise EventError("response.conversation must be 'auto' or 'none'", param="response.conversation")
    metadata = _metadata(response.get("metadata"))
    temperature = response.get("temperature")
    if temperature is not None:
        temperature = check_temperature(temperature, "response.temperature")
    limit_key = "max_output_tokens" if ga else "max_response_output_tokens"
    limit = response.get(limit_key)
    limit = None if limit is None else check_max_tokens(limit, f"response.{limit_key}")
    tools, grammar = _tools(response, config, services)
    # GA's response.audio has one side, its own output's format and voice (checked as a session's)
    output = ga_audio(response.get("audio"), "response.audio", RESPONSE_AUDIO)["output"] if ga else None
    voice = _voice(response, output, services)
    audio_format = _format(response, output)
    return ResponseRequest(
        instructions,
        audio,
        response_items(response.get("input"), conv),
        conversation == "none",
        metadata,
        temperature,
        None if limit is None else reply_tokens(limit),
        limit,
        voice,
        None if audio_format is None else FORMATS[audio_format].rate,
        audio_format,
        tools,
        grammar,
        conv.clock,
    )


# A response's fields by dialect (OpenAI's, and mmserve's ``temperature``): closed sets, so that
# a field this server does not have (or a beta one in a GA request) is refused, not ignored.
_COMMON = ("conversation", "input", "instructions", "metadata", "tool_choice", "tools", "temperature")
BETA_FIELDS = frozenset((*_COMMON, "modalities", "voice", "output_audio_format", "max_response_output_tokens"))
GA_FIELDS = frozenset((*_COMMON, "output_modalities", "audio", "max_output_tokens", "prompt"))


def _check_fields(response: dict[str, Any], ga: bool) -> None:
    if unknown := sorted(set(response) - (GA_FIELDS if ga else BETA_FIELDS)):
        key = unknown[0]
        moved = ga and key in BETA_FIELDS and key in MOVED  # (where a GA session has it, in a response too)
        where = f": a GA response has it as {MOVED[key].replace('session.', 'response.', 1)}" if moved else ""
        raise unknown_parameter(f"response.{key}", where)


def _metadata(metadata: Any) -> dict[str, str] | None:
    """``response.metadata`` as OpenAI takes it: up to 16 pairs of strings, keys up to 64
    characters, values up to 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise EventError("response.metadata must be an object", param="response.metadata")
    if len(metadata) > 16:
        raise EventError(f"response.metadata has {len(metadata)} keys; at most 16", param="response.metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise EventError(
                f"response.metadata[{key[:64]!r}]: keys are up to 64 characters, values strings of up to 512",
                param="response.metadata",
            )
    return metadata


def _voice(response: dict[str, Any], output: dict[str, Any] | None, services: Services) -> str | None:
    """Its own voice (beta ``voice``; GA ``audio.output.voice``, ``output`` the checked
    ``audio.output``), checked."""
    if output is None:
        check_voice(services.tts, response, "response.voice")
        return response.get("voice")
    check_voice(services.tts, output, "response.audio.output.voice")
    return output.get("voice")


def _format(response: dict[str, Any], output: dict[str, Any] | None) -> str | None:
    """Its own output format (beta ``output_audio_format``, GA ``audio.output.format``; None:
    the session's)."""
    if output is None:
        fmt = response.get("output_audio_format")
        return None if fmt is None else wire_format(fmt, "response.output_audio_format")
    fmt = output.get("format")
    return None if fmt is None else ga_wire_format(fmt, "response.audio.output.format")


def _tools(
    response: dict[str, Any], config: SessionConfig, services: Services
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Its own ``tools``/``tool_choice`` (checked as ``session.update`` checks them) as the
    reply's chat-shaped tools ([]: none; None: the session's) and the grammar its
    ``tool_choice`` holds it to."""
    if "tools" not in response and "tool_choice" not in response:
        return None, None
    staged = dataclasses.replace(config)
    patch = {k: response[k] for k in ("tools", "tool_choice") if k in response}
    if not patch.get("tools", True) and "tool_choice" not in patch:  # (none for it: the session's choice cannot hold)
        patch["tool_choice"] = "auto"
    try:
        staged.update(patch)
        grammar = tools_grammar(getattr(services.llm, "tokenizer", None), staged)
    except EventError as exc:
        exc.param = (exc.param or "").replace("session.", "response.", 1)
        raise
    return shown_tools(staged) or [], grammar
