"""What every TTS backend provides, and helpers shared by the backends.

A TTS engine (any object with ``modality == "tts"``) has ``model_name``, ``voices`` (names it
speaks; the first is its default), ``sample_rate`` (its native rate), ``supports_speed``,
``async start()``, ``async shutdown()``, ``stats()``, and::

    def stream(req: TTSRequest) -> AsyncIterator[np.ndarray]

yielding float32 mono chunks at ``req.sample_rate or sample_rate`` as soon as each exists,
and counting what it used in ``req.usage`` (whole when the stream ends).
Input errors (``TTSInputError``) are raised at the first ``__anext__``, before any audio.
Closing the iterator (``aclose()``, task cancellation, leaving an ``async for``) stops the work
for that request inside the engine at once: queued pieces are dropped, AR sequences aborted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

import numpy as np

from modalities.tts.protocol import TTSInputError, TTSRequest, TTSUsage


class TTSEngine(Protocol):
    modality: str
    model_name: str
    voices: list[str]
    sample_rate: int
    supports_speed: bool

    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...
    def stats(self) -> dict[str, float]: ...
    def stream(self, req: TTSRequest) -> AsyncIterator[np.ndarray]: ...


def is_tts_engine(engine: Any) -> bool:
    return getattr(engine, "modality", None) == "tts"


def check_request(engine: TTSEngine, req: TTSRequest) -> str:
    """Validate ``req`` for ``engine``; returns the voice to use (raises ``TTSInputError``)."""
    req.validate()
    voice = req.voice or engine.voices[0]
    if voice not in engine.voices:
        raise TTSInputError(f"voice {voice!r} is not available; choose from {', '.join(engine.voices)}", "voice")
    if req.speed != 1.0 and not engine.supports_speed:
        raise TTSInputError(f"model {engine.model_name!r} does not support speed other than 1.0", "speed")
    return voice


class ReportsUsage:
    """What a TTS engine served by a worker process adds: ``stream_with_usage``."""

    async def stream_with_usage(self, req: TTSRequest) -> AsyncIterator[np.ndarray | TTSUsage]:
        """``stream(req)``'s chunks, then ``req.usage``: what the worker sends back, so that the
        gateway's copy of the request is counted too (``RemoteTTSEngine.stream``)."""
        engine: TTSEngine = self  # type: ignore[assignment]  # (mixed into TTS engines only)
        async with aclosing(engine.stream(req)) as chunks:
            async for chunk in chunks:
                yield chunk
        yield req.usage


async def synthesize(engine: TTSEngine, req: TTSRequest) -> np.ndarray:
    """The whole utterance as one array (collects ``stream``)."""
    chunks = [c async for c in engine.stream(req)]
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
