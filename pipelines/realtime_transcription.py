"""Transcription sessions (``/v1/realtime?intent=transcription``): the user's speech becomes
text as it comes, and nothing replies (live captions, dictation). Only an ASR model is needed.

The session runs the voice pipeline up to the ASR (``pipelines.voice.transcription_pipeline``)
and sends, per turn, the events a conversation session sends for the user's speech, with the
transcript as a ``conversation.item.input_audio_transcription.delta`` (whole, as OpenAI's
``whisper-1`` sends it) before ``.completed``. Its settings are the input side of a session:
beta clients send ``transcription_session.update`` (answered by ``transcription_session.updated``),
GA ones ``session.update`` with ``session.type == "transcription"``. Requests for replies and
text items are refused with an ``error`` event.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pipelines import realtime_ga
from pipelines.realtime_audio import FORMATS
from pipelines.realtime_config import SessionConfig
from pipelines.realtime_events import EventError
from pipelines.realtime_fields import check_language, check_noise_reduction, ga_wire_format
from pipelines.services import Services

# The beta session fields a transcription session has (``transcription_session.update``).
FIELDS = frozenset(
    ("input_audio_format", "input_audio_transcription", "turn_detection", "input_audio_noise_reduction", "include")
)
TRANSCRIPTION_PARAM = "session.input_audio_transcription"
# Client events of conversation sessions only.
REFUSED = frozenset(("response.create", "response.cancel", "conversation.item.create", "conversation.item.truncate"))


def beta_patch(session: Any) -> dict[str, Any]:
    """The ``SessionConfig`` patch of a ``transcription_session.update``'s ``session``."""
    if not isinstance(session, dict):
        raise EventError("session must be an object", param="session")
    unknown = sorted(set(session) - FIELDS - {"modalities"})
    if unknown:
        raise EventError(f"a transcription session has no field {unknown[0]!r}", param=f"session.{unknown[0]}")
    if "input_audio_transcription" in session and session["input_audio_transcription"] is None:
        raise EventError("a transcription session transcribes: its settings cannot be null", param=TRANSCRIPTION_PARAM)
    if "input_audio_noise_reduction" in session:
        check_noise_reduction(session["input_audio_noise_reduction"], "session.input_audio_noise_reduction")
    td = session.get("turn_detection")
    for key in ("create_response", "interrupt_response", "idle_timeout_ms"):  # (the timeout asks for one)
        if isinstance(td, dict) and td.get(key):
            raise EventError("a transcription session makes no responses", param=f"session.turn_detection.{key}")
    return {k: v for k, v in session.items() if k in FIELDS}


def ga_patch(session: dict[str, Any]) -> dict[str, Any]:
    """The beta patch of a GA ``session.update`` of ``type`` "transcription" (its
    ``audio.input``: format, transcription, turn_detection, noise_reduction; and ``include``)."""
    realtime_ga.check_fields(session, realtime_ga.TRANSCRIPTION_FIELDS)
    audio = realtime_ga.ga_audio(session.get("audio"), "session.audio", {"input": realtime_ga.SESSION_AUDIO["input"]})
    side = audio["input"]
    renamed = {
        "format": "input_audio_format",
        "transcription": "input_audio_transcription",
        "noise_reduction": "input_audio_noise_reduction",
    }
    beta = {renamed.get(k, k): v for k, v in side.items()}
    if "input_audio_format" in beta:
        beta["input_audio_format"] = ga_wire_format(beta["input_audio_format"], "session.audio.input.format")
    if "include" in session:
        beta["include"] = session["include"]
    return beta_patch(beta)


def beta_object(config: SessionConfig, session_id: str) -> dict[str, Any]:
    """The beta ``transcription_session`` object."""
    return {
        "id": session_id,
        "object": "realtime.transcription_session",
        "modalities": ["text"],
        "input_audio_format": config.input_audio_format,
        "input_audio_transcription": config.input_audio_transcription,
        "turn_detection": _shown(config.turn_detection),
        "input_audio_noise_reduction": config.input_audio_noise_reduction,
        "include": config.include,
    }


def ga_object(config: SessionConfig, session_id: str) -> dict[str, Any]:
    """The GA session object of ``type`` "transcription"."""
    return {
        "type": "transcription",
        "object": "realtime.transcription_session",
        "id": session_id,
        "audio": {
            "input": {
                "format": dict(FORMATS[config.input_audio_format].ga),
                "transcription": config.input_audio_transcription,
                "turn_detection": _shown(config.turn_detection),
                "noise_reduction": config.input_audio_noise_reduction,
            }
        },
        "include": config.include,
    }


def _shown(td: dict[str, Any] | None) -> dict[str, Any] | None:
    """Turn detection as a transcription session has it (it makes no responses)."""
    return None if td is None else {k: v for k, v in td.items() if k not in ("create_response", "interrupt_response")}


class TranscriptionEvents:
    """The client events that set a transcription session (``RealtimeSession`` shares its state)."""

    config: SessionConfig
    services: Services
    transcription: bool
    ga: bool
    id: str

    if TYPE_CHECKING:  # (RealtimeSession's)

        async def send(self, type_: str, in_conversation: bool = True, **fields: Any) -> None: ...

        def _apply_config(self) -> None: ...

    async def _ga_transcription_update(self, session: Any) -> None:
        """A GA ``session.update`` in a transcription session, or of ``type`` "transcription" in another."""
        kind = session.get("type") if isinstance(session, dict) else None
        if kind != "transcription" or not self.transcription:
            raise EventError(
                "a transcription session is opened with /v1/realtime?intent=transcription and updated with "
                "session.type 'transcription'",
                param="session.type",
            )
        await self._update_transcription(session, "session.updated", ga=True)

    async def _ev_transcription_session_update(self, event: dict[str, Any]) -> None:
        if not self.transcription:
            raise EventError("this is a conversation session; send session.update", "unsupported", "type")
        await self._update_transcription(event.get("session", {}), "transcription_session.updated", ga=False)

    async def _update_transcription(self, session: Any, reply: str, ga: bool) -> None:
        """Apply the settings (all or nothing), then ``reply`` with the session object."""
        try:
            patch = ga_patch(session) if ga else beta_patch(session)
            staged = dataclasses.replace(self.config)
            staged.update(patch)
            if "input_audio_transcription" in patch:
                check_language(self.services.asr, staged.input_audio_transcription)
            semantic = (staged.turn_detection or {}).get("type") == "semantic_vad"
            if semantic and self.services.llm is None:
                raise EventError(
                    "semantic_vad needs a served LLM to judge the turns, and this server serves none; use server_vad",
                    param="session.turn_detection.type",
                )
        except EventError as exc:
            raise realtime_ga.ga_error(exc) if ga else exc from None
        self.config = staged
        self.ga = self.ga or ga  # (only GA has this shape: GA events from here on)
        self._apply_config()
        await self.send(reply, session=(ga_object if ga else beta_object)(self.config, self.id))
