"""OpenAI-compatible ``POST /v1/audio/speech``, streamed.

The handler waits for the first audio chunk before answering, so input and engine errors are
proper 4xx/5xx JSON; after that every chunk is encoded and sent as soon as the engine yields it
(chunked transfer; ``stream_format: "sse"`` wraps the same bytes in ``speech.audio.delta``
events). Time-to-first-audio is therefore the time to synthesise the first text piece. A client
that disconnects closes the engine stream, which cancels the rest of the synthesis.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from gateway.errors import APIError, from_engine_error
from gateway.streaming import SSE_HEADERS, sse
from modalities.audio import MEDIA_TYPES, StreamEncoder
from modalities.tts.base import check_request
from modalities.tts.protocol import PCM_RATE, SpeechRequest, TTSInputError
from modalities.tts.registry import resolve_tts

router = APIRouter(tags=["audio"], strict_content_type=False)


def _input_error(exc: TTSInputError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code="invalid_value")


async def _first_chunk(gen: AsyncIterator[np.ndarray]) -> np.ndarray | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None
    except TTSInputError as exc:
        raise _input_error(exc) from exc
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        mapped = from_engine_error(exc, param="input")
        if mapped is None:
            raise
        raise mapped from exc


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request) -> Any:
    """OpenAI ``POST /v1/audio/speech``: audio bytes in ``response_format``, streamed."""
    state = request.app.state
    name, engine, voice = resolve_tts(state.engines, body.model, body.voice, getattr(state, "aliases", {}))
    try:
        req = body.to_engine(voice)
        check_request(engine, req)
    except TTSInputError as exc:
        raise _input_error(exc) from exc
    fmt = body.response_format
    rate = req.sample_rate or (PCM_RATE if fmt == "pcm" else engine.sample_rate)
    req.sample_rate = rate
    gen = engine.stream(req)
    try:
        first = await _first_chunk(gen)
    except BaseException:
        await gen.aclose()
        raise
    encoder = StreamEncoder(fmt, rate)

    async def audio_bytes() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield encoder.encode(first)
                async for chunk in gen:
                    data = encoder.encode(chunk)
                    if data:
                        yield data
            yield encoder.close()
        finally:
            await gen.aclose()

    headers = {"X-Sample-Rate": str(rate), "X-Model": name, "X-Voice": voice}
    if body.stream_format == "audio":
        return StreamingResponse(audio_bytes(), media_type=MEDIA_TYPES[fmt], headers=headers)

    async def events() -> AsyncIterator[str]:
        async for data in audio_bytes():
            if data:
                yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        yield sse({"type": "speech.audio.done"})

    return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
