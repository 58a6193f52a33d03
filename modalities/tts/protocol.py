"""TTS data at the boundaries: the engine request (``TTSRequest``, plain and picklable so remote
workers and the realtime pipeline can use it) and the OpenAI ``POST /v1/audio/speech`` body."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

MAX_INPUT_CHARS = 4096  # OpenAI's limit for /v1/audio/speech
MIN_SPEED, MAX_SPEED = 0.25, 4.0
RESPONSE_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
PCM_RATE = 24_000  # OpenAI's raw ``pcm`` is 24 kHz mono PCM16
# Syntheses a Piper voice holds at once past which the route's requests get 429 (``--tts-max-requests``):
# about as many streams as it keeps at real time (on 2 cores, 8 at once ran at a real-time factor of
# 0.28, 24 at once at 1.35: 10 s of audio each in 13.6 s).
DEFAULT_MAX_REQUESTS = min(8 * (os.cpu_count() or 1), 128)  # (a speech worker runs a thread per request)

# OpenAI's voice names: apps send them, so they play the server's default voice.
OPENAI_VOICES = (
    *("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse"),
    *("marin", "cedar"),  # the Realtime API's newest
)
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


class TTSInputError(ValueError):
    """A request the engine cannot serve (empty text, unknown voice, bad speed); the API maps it
    to 400 with ``param`` naming the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class TTSUsage:
    """What one synthesis used, in OpenAI's ``speech.audio.done`` terms: ``input_tokens`` the
    model read (Piper: phoneme ids; an AR model: its prompts' tokens), ``output_tokens`` it
    generated (an AR model's codec tokens, its end-of-audio tokens included; Piper: none)."""

    input_tokens: int = 0
    output_tokens: int = 0


@dataclass
class TTSRequest:
    """One synthesis: ``text`` spoken by ``voice`` (None: the engine's default) at ``speed``
    (1.0 normal, >1 faster), as float32 mono chunks at ``sample_rate`` (None: the voice's own).
    ``priority``: lower first where the engine orders its work (set by the server, not the API:
    ``engine.foreground.INTERACTIVE`` marks a live voice turn). ``usage``: filled in by the
    engine as it synthesises, whole once the stream has ended. ``refusable``: the engine may
    refuse it with ``HeldBoundError`` when it holds its bound of requests
    (``engine.admission``): the HTTP route's requests; a job's or a live turn's wait instead."""

    text: str
    voice: str | None = None
    speed: float = 1.0
    sample_rate: int | None = None
    priority: int = 0
    usage: TTSUsage = field(default_factory=TTSUsage)
    refusable: bool = False

    def validate(self) -> None:
        if not self.text or not self.text.strip():
            raise TTSInputError("input must be a non-empty string", "input")
        if len(self.text) > MAX_INPUT_CHARS:
            raise TTSInputError(f"input is {len(self.text)} characters; the maximum is {MAX_INPUT_CHARS}", "input")
        if not MIN_SPEED <= self.speed <= MAX_SPEED:
            raise TTSInputError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {self.speed}", "speed")
        if self.sample_rate is not None and not 8_000 <= self.sample_rate <= 48_000:
            raise TTSInputError(f"sample_rate must be in [8000, 48000], got {self.sample_rate}", "sample_rate")


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech`` body. ``stream_format``: ``audio`` streams the encoded file with
    chunked transfer (always, as chunks exist); ``sse`` sends ``speech.audio.delta`` events with
    base64 audio. Extra: ``sample_rate`` overrides the output rate. ``instructions`` is accepted
    and ignored (no voice here takes instructions)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    input: StrictStr
    model: str | None = None
    voice: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    sample_rate: int | None = Field(default=None)

    @field_validator("speed", "sample_rate", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would take true as 1
            raise ValueError("must be a number, not a boolean")
        return value

    def to_engine(self, voice: str | None) -> TTSRequest:
        req = TTSRequest(self.input, voice, self.speed, self.sample_rate, refusable=True)
        req.validate()
        return req
