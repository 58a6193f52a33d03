"""The settings a ``session.update`` and a ``response.create`` share, each value checked (voice,
speed, output modalities, temperature, token limit, instructions, audio formats in the beta and
GA shapes), and the session's transcription language and noise reduction: a value refused is an
``EventError`` that names its parameter."""

from __future__ import annotations

import json
from typing import Any

from modalities.asr.types import check_asr_language
from modalities.tts.registry import unknown_voice
from pipelines.realtime_audio import FORMATS
from pipelines.realtime_events import EventError

MAX_INSTRUCTIONS_CHARS = 16_384
MAX_REPLY_TOKENS = 256  # a reply's tokens under "inf"


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
