"""The engines a speech pipeline calls, behind two small functions.

``Services.from_engines(engines)`` picks the LLM, the ASR engine and the TTS engine
(by ``gateway.metrics.engine_modality``, as the routes pick theirs) out of a served-name -> engine
map (the gateway's ``app.state.engines`` or a worker's), optionally by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.metrics import engine_modality

if TYPE_CHECKING:
    from modalities.asr.types import Transcript


class ServiceMissing(LookupError):
    """The pipeline needs an engine that is not served here."""


def has_modality(engines: dict[str, Any], modality: str) -> bool:
    return any(engine_modality(engine) == modality for engine in engines.values())


def pick(engines: dict[str, Any], modality: str, name: str | None = None, aliases: dict[str, str] | None = None) -> Any:
    """The engine ``name`` (or the first one) of ``modality``; ``ServiceMissing`` if none."""
    if name is not None:
        name = (aliases or {}).get(name, name)
        engine = engines.get(name)
        if engine is None or engine_modality(engine) != modality:
            raise ServiceMissing(f"no {modality} model named {name!r} is served")
        return engine
    for engine in engines.values():
        if engine_modality(engine) == modality:
            return engine
    raise ServiceMissing(f"no {modality} model is served")


@dataclass
class Services:
    llm: Any = None
    asr: Any = None
    tts: Any = None

    @classmethod
    def from_engines(
        cls,
        engines: dict[str, Any],
        llm: str | None = None,
        asr: str | None = None,
        tts: str | None = None,
        aliases: dict[str, str] | None = None,
        need: tuple[str, ...] = ("llm", "asr", "tts"),
    ) -> Services:
        """Engines for the pipeline; those in ``need`` must exist, the others are optional."""
        found: dict[str, Any] = {}
        for modality, name in (("llm", llm), ("asr", asr), ("tts", tts)):
            try:
                found[modality] = pick(engines, modality, name, aliases)
            except ServiceMissing:
                if modality in need or name is not None:
                    raise
                found[modality] = None
        return cls(**found)

    async def transcribe(
        self,
        samples: np.ndarray,
        priority: int = 0,
        language: str | None = None,
        prompt: str | None = None,
        logprobs: bool = False,
        vad: bool | None = False,
    ) -> Transcript:
        """The transcript of one 16 kHz mono utterance (``priority``, ``language``, ``prompt``,
        ``logprobs``, ``vad``: as ``TranscriptionRequest``'s). ``vad`` False by default: a turn
        has been through the session's own VAD (its threshold, its floor); the ASR's defaults
        must not judge it again."""
        if self.asr is None:
            raise ServiceMissing("no asr model is served")
        from modalities.asr.engine import TranscriptionRequest

        req = TranscriptionRequest(
            np.asarray(samples, np.float32),
            language=language,
            prompt=prompt,
            vad=vad,
            priority=priority,
            logprobs=logprobs,
        )
        return await self.asr.run(req)

    async def speak(
        self, text: str, voice: str | None, sample_rate: int, priority: int = 0, speed: float = 1.0
    ) -> AsyncIterator[np.ndarray]:
        """Float32 chunks of ``text`` spoken at ``sample_rate``; closing the iterator stops the
        synthesis inside the TTS engine (``priority``, ``speed``: ``TTSRequest``'s)."""
        if self.tts is None:
            raise ServiceMissing("no tts model is served")
        from modalities.tts.protocol import TTSRequest

        voices = getattr(self.tts, "voices", None) or []
        stream = self.tts.stream(TTSRequest(text, voice if voice in voices else None, speed, sample_rate, priority))
        try:
            async for chunk in stream:
                yield np.asarray(chunk, np.float32)
        finally:
            await stream.aclose()
