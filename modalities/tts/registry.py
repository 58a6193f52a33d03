"""Which TTS engine and voice answer a request: voice name -> backend.

Every served TTS engine lists its ``voices``; the first TTS engine served is the default.
``model`` may name a served TTS engine (or an alias of one), one of OpenAI's TTS model names, or be
omitted; OpenAI's voice names (``alloy``, ...) play the chosen engine's default voice so existing
apps work unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.errors import APIError, model_not_found
from modalities.tts.base import is_tts_engine
from modalities.tts.protocol import OPENAI_MODELS, OPENAI_VOICES


def unknown_voice(voice: str, voices: Iterable[str]) -> str | None:
    """The error for a voice that is neither one of ``voices`` nor one of OpenAI's names (those
    play the default voice), else ``None``."""
    voices = list(voices)
    if voice in voices or voice.lower() in OPENAI_VOICES:
        return None
    return f"voice {voice!r} is not available; choose from {', '.join(sorted({*voices, *OPENAI_VOICES}))}"


def tts_engines(engines: dict[str, Any]) -> dict[str, Any]:
    return {name: e for name, e in engines.items() if is_tts_engine(e)}


def resolve_tts(
    engines: dict[str, Any], model: str | None, voice: str | None, aliases: dict[str, str] | None = None
) -> tuple[str, Any, str]:
    """``(served name, engine, voice)``; raises ``APIError`` 400 (no TTS served, not a TTS model,
    unknown voice) or 404 (unknown model)."""
    tts = tts_engines(engines)
    if not tts:
        raise APIError(
            400, "no text-to-speech model is served (include tts in --only; --tts picks the voice)", param="model"
        )
    fixed: str | None = None
    if model is not None and model not in OPENAI_MODELS:
        name = model if model in engines else (aliases or {}).get(model, model)
        if name not in tts:
            if name in engines:
                raise APIError(400, f"the model `{model}` does not support speech", param="model", code="invalid_model")
            raise model_not_found(model, list(tts))
        fixed = name
    candidates = {fixed: tts[fixed]} if fixed else tts
    if voice is not None and (error := unknown_voice(voice, {v for e in candidates.values() for v in e.voices})):
        raise APIError(400, error, param="voice")
    if voice is None or voice.lower() in OPENAI_VOICES:
        name = next(iter(candidates))
        return name, candidates[name], candidates[name].voices[0]
    return next((name, engine, voice) for name, engine in candidates.items() if voice in engine.voices)
