"""OpenAI Realtime wire format: validation of client events and the session object.

Only the subset mmserve serves is accepted; anything else is an ``EventError`` that the session
reports as an ``error`` event (the connection stays usable).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.errors import lone_surrogate, may_hold_lone_surrogate
from modalities.asr.types import check_asr_language
from modalities.llm.structured import reply_grammar
from modalities.llm.tools import MAX_TOOLS, ToolError, check_function, check_tool_choice
from modalities.llm.tools import check_template as tools_template
from modalities.tts.registry import unknown_voice
from pipelines.conversation import DEFAULT_INSTRUCTIONS
from pipelines.realtime_audio import FORMATS, WireFormat
from pipelines.turns import EAGERNESS

MAX_APPEND_BYTES = 15 * (1 << 20)  # an append's audio, as OpenAI's cap (a larger one: an error event)
# The WebSocket frame size the server reads (uvicorn's ``ws_max_size``): well over the largest
# append (~20 MiB of base64 with its event), so that a larger append is read and refused with
# the session's error event, not a closed socket; bounded, as an HTTP body is (``--max-body-mb``'s
# default), so that a frame costs at most this much to read: a larger one closes the socket (1009).
WS_MAX_BYTES = 32 << 20
MAX_INSTRUCTIONS_CHARS = 16_384


class EventError(ValueError):
    def __init__(
        self, message: str, code: str = "invalid_value", param: str | None = None, event_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.param, self.event_id = code, param, event_id


def item_id_of(event: dict[str, Any]) -> str:
    """The ``item_id`` an item event names (OpenAI's errors when it is missing or no string)."""
    item_id = event.get("item_id")
    if item_id is None:
        raise EventError("Missing required parameter: 'item_id'.", "missing_required_parameter", "item_id")
    if not isinstance(item_id, str):
        raise EventError("item_id must be a string", param="item_id")
    return item_id


def unknown_parameter(param: str, where: str = "", error: type[EventError] = EventError) -> EventError:
    """OpenAI's error for a field the object does not have, in one wording for both dialects:
    ``param`` its path, ``where`` where the other dialect has it (``": a GA session has it as
    ..."``)."""
    return error(f"Unknown parameter: '{param}'{where}.", "unknown_parameter", param)


def parse_event(raw: str, known: frozenset[str]) -> dict[str, Any]:
    """A client event's text as a JSON object with a ``type`` in ``known`` and, if any, a string
    ``event_id``; otherwise an ``EventError`` (carrying the ``event_id`` once that is valid)."""
    try:
        event = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise EventError(f"the event is not valid JSON: {exc.msg}", code="invalid_json") from exc
    except RecursionError as exc:
        raise EventError("the event is nested too deeply", code="invalid_json") from exc
    event_id = event.get("event_id") if isinstance(event, dict) else None
    if event_id is not None and (not isinstance(event_id, str) or len(event_id) > 512):
        raise EventError("event_id must be a string of at most 512 characters", param="event_id")  # not echoed
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise EventError("an event must be a JSON object with a string 'type'", param="type", event_id=event_id)
    where = lone_surrogate(event) if may_hold_lone_surrogate(raw) else None
    if where is not None:
        raise EventError("a lone surrogate is not a character", param=where or None, event_id=event_id)
    if event["type"] not in known:
        raise EventError(f"unknown or unsupported event type {event['type']!r}", param="type", event_id=event_id)
    return event


@dataclass
class SessionConfig:
    """The ``session`` object (the fields mmserve honours)."""

    model: str
    modalities: list[str] = field(default_factory=lambda: ["text", "audio"])
    instructions: str = DEFAULT_INSTRUCTIONS
    voice: str | None = None
    turn_detection: dict[str, Any] | None = field(
        default_factory=lambda: {
            "type": "server_vad",
            "threshold": 0.5,
            "prefix_padding_ms": 300,
            "silence_duration_ms": 500,
            "create_response": True,
            "interrupt_response": True,
        }
    )
    temperature: float = 0.8
    max_response_output_tokens: int | str = "inf"
    speed: float = 1.0  # of the spoken replies (OpenAI's range: 0.25 to 1.5)
    input_audio_format: str = "pcm16"  # a ``pipelines.realtime_audio.FORMATS`` name
    output_audio_format: str = "pcm16"
    # ``language`` and ``prompt`` reach the ASR. Null sends no ``input_audio_transcription``
    # events, as OpenAI's; the turns are still transcribed (the replies need the text). On by
    # default here (OpenAI's default is null): mmserve transcribes every turn anyway.
    input_audio_transcription: dict[str, Any] | None = field(default_factory=lambda: {"model": "whisper"})
    # Functions the model may call (Realtime's flat shape); "none": not shown to the model.
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    # [LOGPROBS]: the transcription events carry the transcript's token logprobs.
    include: list[str] | None = None
    # {"type": "near_field" | "far_field"}: turn detection hears the input noise-suppressed.
    input_audio_noise_reduction: dict[str, str] | None = None

    def to_dict(self, session_id: str) -> dict[str, Any]:
        return {
            "id": session_id,
            "object": "realtime.session",
            "model": self.model,
            "modalities": self.modalities,
            "instructions": self.instructions,
            "voice": self.voice,
            "speed": self.speed,
            "input_audio_format": self.input_audio_format,
            "output_audio_format": self.output_audio_format,
            "input_audio_transcription": self.input_audio_transcription,
            "turn_detection": self.turn_detection,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "temperature": self.temperature,
            "max_response_output_tokens": self.max_response_output_tokens,
            "include": self.include,
            "input_audio_noise_reduction": self.input_audio_noise_reduction,
        }

    def check_beta_fields(self, patch: dict[str, Any]) -> None:
        """An ``unknown_parameter`` error for the first field of a beta ``session.update`` that a
        beta session does not have (the fields of the object the server sends, which a client may
        send back whole, and OpenAI's ``tracing``, ``client_secret`` and ``expires_at``, taken and
        not used): a misspelt field is refused, not ignored."""
        known = {*self.to_dict(""), "tracing", "client_secret", "expires_at"}
        if unknown := sorted(set(patch) - known):
            raise unknown_parameter(f"session.{unknown[0]}")

    def update(self, patch: Any) -> None:
        """Apply a ``session.update``'s ``session`` object (all-or-nothing)."""
        if not isinstance(patch, dict):
            raise EventError("session must be an object", param="session")
        new = dict(vars(self))
        if "model" in patch and not isinstance(patch["model"], str):  # (a session keeps its model)
            raise EventError("model must be a string", param="session.model")
        if "input_audio_noise_reduction" in patch:
            value = patch["input_audio_noise_reduction"]
            check_noise_reduction(value, "session.input_audio_noise_reduction")
            new["input_audio_noise_reduction"] = None if value is None else {"type": value["type"]}
        if "modalities" in patch:  # (audio comes with its transcript: ["audio"] alone is no choice)
            audio = wants_audio(patch["modalities"], False, "session.modalities")
            new["modalities"] = ["text", "audio"] if audio else ["text"]
        if "voice" in patch:
            if patch["voice"] is not None and not isinstance(patch["voice"], str):
                raise EventError("voice must be a string", param="session.voice")
            new["voice"] = patch["voice"]
        if "speed" in patch:
            new["speed"] = check_number(patch["speed"], 0.25, 1.5, "session.speed")
        if "instructions" in patch:
            new["instructions"] = check_instructions(
                "" if patch["instructions"] is None else patch["instructions"], "session.instructions"
            )
        for key in ("input_audio_format", "output_audio_format"):
            if key in patch:
                new[key] = wire_format(patch[key], f"session.{key}")
        if "temperature" in patch:
            new["temperature"] = check_temperature(patch["temperature"], "session.temperature")
        if "max_response_output_tokens" in patch:
            m = patch["max_response_output_tokens"]
            new["max_response_output_tokens"] = check_max_tokens(m, "session.max_response_output_tokens")
        if "turn_detection" in patch:
            new["turn_detection"] = _turn_detection(patch["turn_detection"], self.turn_detection)
        if "tools" in patch:
            new["tools"] = check_session_tools(patch["tools"])
        if "tool_choice" in patch:
            try:
                check_tool_choice(patch["tool_choice"], "session.tool_choice")
            except ToolError as exc:
                raise EventError(str(exc), param=exc.param) from None
            new["tool_choice"] = patch["tool_choice"] or "auto"
        if "input_audio_transcription" in patch:
            new["input_audio_transcription"] = _transcription(
                patch["input_audio_transcription"], self.input_audio_transcription
            )
        if "include" in patch:
            include = patch["include"]
            if include is not None and (not isinstance(include, list) or any(x != LOGPROBS for x in include)):
                raise EventError(f"include may only hold {LOGPROBS!r}", param="session.include")
            new["include"] = [LOGPROBS] if include else None
        vars(self).update(new)

    @property
    def logprobs(self) -> bool:
        """Whether the transcription events carry the transcript's token logprobs."""
        return LOGPROBS in (self.include or [])


MAX_TRANSCRIPTION_PROMPT_CHARS = 4000
LOGPROBS = "item.input_audio_transcription.logprobs"  # what ``include`` may hold
MAX_REPLY_TOKENS = 256  # a reply's tokens under "inf"


def _transcription(value: Any, current: dict[str, Any] | None) -> dict[str, Any] | None:
    """A session's ``input_audio_transcription``: ``model`` (any name: the served ASR model
    transcribes), ``language`` (a Whisper language code, lower-cased) and ``prompt``, each a
    string or absent. A field the patch leaves out keeps its value (OpenAI: "only the fields that
    are present are updated"); null or "" clears it."""
    param = "session.input_audio_transcription"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise EventError("the transcription settings must be an object or null", param=param)
    out = dict(current or {})
    limits = {"model": 200, "language": 16, "prompt": MAX_TRANSCRIPTION_PROMPT_CHARS}
    for key, limit in limits.items():
        if key not in value:
            continue
        v = value[key]
        if isinstance(v, str) and key == "language":
            v = v.strip().lower()
        if v is None or v == "":  # as absent (the HTTP API reads an empty form field so too)
            out.pop(key, None)
            continue
        if not isinstance(v, str) or len(v) > limit:
            raise EventError(f"{key} must be a string of at most {limit} characters", param=f"{param}.{key}")
        out[key] = v
    return {"model": "whisper", **out}


SEMANTIC_VAD = {"type": "semantic_vad", "eagerness": "auto", "create_response": True, "interrupt_response": True}
# OpenAI's turn_detection fields besides server VAD's numbers (mmserve's extensions are among those)
TURN_DETECTION_FIELDS = ("type", "eagerness", "create_response", "interrupt_response", "idle_timeout_ms")
IDLE_TIMEOUT_MS = (5000, 30000)  # OpenAI's range


def _turn_detection(td: Any, current: dict[str, Any] | None) -> dict[str, Any] | None:
    """``server_vad`` (silence ends a turn) or ``semantic_vad`` (``pipelines.turns``: what was
    said so far tells whether a pause ends it; ``eagerness`` as OpenAI's). The patch's fields
    update the current ones of its type; another type starts from its defaults."""
    if td is None:
        return None
    kind = td.get("type", (current or {}).get("type", "server_vad")) if isinstance(td, dict) else None
    if kind not in ("server_vad", "semantic_vad"):
        raise EventError(
            "turn_detection must be null or {'type': 'server_vad' or 'semantic_vad', ...}",
            param="session.turn_detection",
        )
    defaults = SEMANTIC_VAD if kind == "semantic_vad" else SessionConfig("").turn_detection or {}
    out = dict(current if current and current.get("type") == kind else defaults)
    limits = {
        "threshold": (0.0, 1.0),
        "prefix_padding_ms": (0, 5000),
        "silence_duration_ms": (0, 10000),
        "speculative_silence_ms": (0, 10000),  # mmserve's extensions, echoed only once set
        "silence_floor_dbfs": (-120, 0),
    }
    if unknown := sorted(td.keys() - {*limits, *TURN_DETECTION_FIELDS}):
        raise unknown_parameter(f"session.turn_detection.{unknown[0]}")
    other = {"eagerness"} if kind == "server_vad" else {*limits, "idle_timeout_ms"}
    if misplaced := sorted(other & td.keys()):
        takes = (
            "eagerness"
            if kind == "semantic_vad"
            else "threshold, prefix_padding_ms, silence_duration_ms, idle_timeout_ms"
        )
        raise EventError(
            f"turn_detection.{misplaced[0]} is not a {kind} setting ({kind} takes {takes}, "
            "create_response and interrupt_response)",
            param=f"session.turn_detection.{misplaced[0]}",
        )
    for key, (lo, hi) in limits.items() if kind == "server_vad" else ():
        if key in td:
            v = td[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
                raise EventError(f"turn_detection.{key} must be in [{lo}, {hi}]", param=f"session.turn_detection.{key}")
            out[key] = v
    if kind == "semantic_vad" and "eagerness" in td:
        if not isinstance(td["eagerness"], str) or td["eagerness"] not in EAGERNESS:
            choices = ", ".join(EAGERNESS)
            raise EventError(
                f"turn_detection.eagerness must be one of {choices}", param="session.turn_detection.eagerness"
            )
        out["eagerness"] = td["eagerness"]
    for key in ("create_response", "interrupt_response"):
        if key in td:
            if not isinstance(td[key], bool):
                raise EventError(f"turn_detection.{key} must be a boolean", param=f"session.turn_detection.{key}")
            out[key] = td[key]
    if "idle_timeout_ms" in td:  # (pipelines.realtime_idle; echoed only once set)
        out["idle_timeout_ms"] = check_idle_timeout(td["idle_timeout_ms"])
    return out


def check_idle_timeout(value: Any) -> int | None:
    """``turn_detection.idle_timeout_ms``: null (off) or whole milliseconds in OpenAI's range."""
    lo, hi = IDLE_TIMEOUT_MS
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi):
        raise EventError(
            f"turn_detection.idle_timeout_ms must be null or an integer in [{lo}, {hi}]",
            param="session.turn_detection.idle_timeout_ms",
        )
    return value


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


def check_voice(tts: Any, patch: Any, param: str = "session.voice") -> None:
    """A voice the TTS lacks is refused (OpenAI's names play the default voice), as
    ``/v1/audio/speech`` refuses it."""
    voice = patch.get("voice") if isinstance(patch, dict) else None
    if voice is not None and not isinstance(voice, str):
        raise EventError("voice must be a string", param=param)
    voices = getattr(tts, "voices", None)
    error = unknown_voice(voice, voices) if isinstance(voice, str) and voices else None
    if error is not None:
        raise EventError(error, param=param)


def check_language(asr: Any, heard: dict[str, Any] | None) -> None:
    """A transcription language the served ASR model lacks is refused at ``session.update``, not
    at each turn. A model in another process is not asked: a code Whisper does not know is
    refused, and one its model lacks fails that turn's transcription."""
    language = (heard or {}).get("language")
    if language is None:
        return
    try:
        check_asr_language(asr, language)
    except ValueError as exc:
        raise EventError(str(exc), param="session.input_audio_transcription.language") from None


NOISE_REDUCTION_TYPES = ("near_field", "far_field")


def check_noise_reduction(value: Any, param: str) -> None:
    """Null or ``{"type": "near_field" | "far_field"}``."""
    if value is not None and (
        not isinstance(value, dict) or set(value) != {"type"} or value["type"] not in NOISE_REDUCTION_TYPES
    ):
        raise EventError(
            f"{param.rsplit('.', 1)[-1]} must be null or an object with type one of {list(NOISE_REDUCTION_TYPES)}",
            param=param,
        )


def wants_audio(mods: Any, ga: bool, param: str) -> bool:
    """Whether output modalities ask for audio: a ``response.create``'s beta ``modalities``
    ``["text"]`` or ``["text", "audio"]``, or GA ``output_modalities`` (response or session)
    ``["text"]`` or ``["audio"]``."""
    allowed = (["text"], ["audio"]) if ga else (["text"], ["text", "audio"], ["audio", "text"])
    if mods not in allowed:
        raise EventError(f"{param.split('.')[-1]} must be one of {list(allowed)}", param=param)
    return "audio" in mods


def check_number(value: Any, lo: float, hi: float, param: str) -> float:
    """``value`` as a float if it is a number (not a boolean) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise EventError(f"{param.rsplit('.', 1)[-1]} must be a number in [{lo:g}, {hi:g}]", param=param)
    return float(value)


def check_temperature(value: Any, param: str) -> float:
    return check_number(value, 0.0, 2.0, param)


def check_max_tokens(value: Any, param: str) -> int | str:
    """A reply's token limit: an integer in [1, 4096], or "inf"."""
    if value != "inf" and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096):
        raise EventError(f"{param.rsplit('.', 1)[-1]} must be an integer in [1, 4096] or 'inf'", param=param)
    return value  # type: ignore[no-any-return]


def reply_tokens(limit: int | str) -> int:
    """The engine's ``max_tokens`` for a checked limit ("inf": as many as a reply gets here)."""
    return MAX_REPLY_TOKENS if limit == "inf" else int(limit)


def check_instructions(value: Any, param: str) -> str:
    """``value`` if it is a string of at most ``MAX_INSTRUCTIONS_CHARS`` characters."""
    if not isinstance(value, str):
        raise EventError("instructions must be a string", param=param)
    if len(value) > MAX_INSTRUCTIONS_CHARS:
        raise EventError(
            f"instructions are too long: {len(value)} characters, at most {MAX_INSTRUCTIONS_CHARS}",
            code="string_above_max_length",
            param=param,
        )
    return value


def wire_format(name: Any, param: str) -> str:
    """A beta format name, checked."""
    if not isinstance(name, str) or name not in FORMATS:
        raise EventError(
            f"{param.rsplit('.', 1)[-1]} {json.dumps(name)} is not supported; use one of {json.dumps(list(FORMATS))}",
            param=param,
        )
    return name


def ga_wire_format(value: Any, param: str) -> str:
    """The beta name of a GA format object (``{"type": "audio/pcm", "rate": 24000}``,
    ``{"type": "audio/pcmu"}``, ``{"type": "audio/pcma"}``); a missing type is pcm, a missing or
    null rate the type's own."""
    if isinstance(value, dict) and set(value) <= {"type", "rate"}:
        kind = value.get("type", "audio/pcm")
        for f in FORMATS.values():
            if kind == f.ga["type"] and value.get("rate") in (None, f.rate):
                return f.name
    shapes = json.dumps([f.ga for f in FORMATS.values()])
    raise EventError(
        f"{param.removeprefix('session.')} {json.dumps(value)} is not supported; use one of {shapes}", param=param
    )


def decode_append(value: Any, fmt: WireFormat) -> np.ndarray:
    """The samples of an ``input_audio_buffer.append``'s base64 ``audio`` in ``fmt``."""
    if not isinstance(value, str):
        raise EventError("audio must be a base64 string", param="audio")
    if len(value) > MAX_APPEND_BYTES * 4 // 3 + 4:
        raise EventError("audio chunk is too large (15 MiB max)", param="audio")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EventError(f"audio is not valid base64: {exc}", param="audio") from exc
    if len(data) % fmt.width:
        raise EventError(f"{fmt.name} audio must have an even number of bytes", param="audio")
    return fmt.decode(data)
