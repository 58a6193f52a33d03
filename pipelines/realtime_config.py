"""A Realtime session's settings: the ``session`` object (``SessionConfig``), as the server
sends it and as a ``session.update`` changes it (all-or-nothing, each field checked), with its
turn detection (server or semantic VAD, the idle timeout) and its input transcription."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modalities.llm.tools import ToolError, check_tool_choice
from pipelines.conversation import DEFAULT_INSTRUCTIONS
from pipelines.realtime_events import EventError, unknown_parameter
from pipelines.realtime_fields import (
    check_instructions,
    check_max_tokens,
    check_noise_reduction,
    check_number,
    check_temperature,
    wants_audio,
    wire_format,
)
from pipelines.realtime_tools import check_session_tools
from pipelines.turns import EAGERNESS


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
