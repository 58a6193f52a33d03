"""OpenAI-compatible ``POST /v1/audio/speech``, streamed.

The handler waits for the first audio chunk before answering, so input and engine errors are
proper 4xx/5xx JSON; after that every chunk is encoded and sent as soon as the engine yields it
(chunked transfer; ``stream_format: "sse"`` wraps the same bytes in ``speech.audio.delta``
events, then ``speech.audio.done`` with the request's token ``usage``, ``TTSUsage``).
Time-to-first-audio is therefore the time to synthesise the first text piece. A client that
disconnects closes the engine stream, which cancels the rest of the synthesis. A later
sentence the phonemiser can't take is a 400 before the first chunk (Piper phonemises ahead); a
failure after the first chunk (an engine's) ends an SSE stream with an ``error`` event
(``gateway.streaming.error_event``), and an audio stream without its closing chunk (the status
line is gone).

Rate limit (``audio_seconds``): admission charges an estimate from the text
(``estimate_seconds``: about 15 characters of English per second of speech at speed 1); when
the stream ends the charge is settled to the duration actually synthesised (also when the
client left early); a request that fails, before or during the stream, is refunded.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from gateway.errors import APIError, from_engine_error
from gateway.ratelimit import charge
from gateway.streaming import SSE_HEADERS, ClosingStreamingResponse, error_event, sse, unless_disconnected
from modalities.audio import MEDIA_TYPES, StreamEncoder
from modalities.tts.base import check_request
from modalities.tts.protocol import PCM_RATE, SpeechRequest
from modalities.tts.registry import resolve_tts

router = APIRouter(tags=["audio"], strict_content_type=False)

CHARS_PER_SECOND = 15.0  # typical read English (~150 words/min); only an admission estimate


def estimate_seconds(text: str, speed: float) -> float:
    """Seconds of speech ``text`` will likely last at ``speed`` (what admission charges)."""
    return max(1.0, len(text) / CHARS_PER_SECOND / speed)


def nothing_to_speak() -> APIError:
    """The 400 for an input the voice made no audio of (zero-width spaces, lone punctuation: what
    is silent depends on the voice, so only its synthesis tells): an empty file is no answer."""
    return APIError(400, "input has nothing the voice can speak", param="input", code="invalid_value")


async def _first_chunk(gen: AsyncIterator[np.ndarray]) -> np.ndarray | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        mapped = from_engine_error(exc, param="input")  # (a TTSInputError: a 400 naming its param)
        if mapped is None:
            raise
        raise mapped from exc


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request) -> Any:
    """OpenAI ``POST /v1/audio/speech``: audio bytes in ``response_format``, streamed."""
    state = request.app.state
    name, engine, voice = resolve_tts(state.engines, body.model, body.voice, getattr(state, "aliases", {}))
    req = body.to_engine(voice)  # a TTSInputError is a ValueError: the app's handler makes it a 400
    check_request(engine, req)
    fmt = body.response_format
    rate = req.sample_rate or (PCM_RATE if fmt == "pcm" else engine.sample_rate)
    req.sample_rate = rate
    ch = await charge(request, "audio_seconds", estimate_seconds(req.text, req.speed))
    gen = engine.stream(req)
    try:
        first = await unless_disconnected(request, _first_chunk(gen))  # (a client gone before it: 499)
    except BaseException:
        await gen.aclose()
        await ch.refund()
        raise
    if first is None:
        await gen.aclose()
        await ch.refund()
        raise nothing_to_speak()
    encoder = StreamEncoder(fmt, rate)
    samples = len(first)

    async def audio_bytes() -> AsyncIterator[bytes]:
        nonlocal samples
        failed = False
        try:
            yield encoder.encode(first)
            async for chunk in gen:
                samples += len(chunk)
                data = encoder.encode(chunk)
                if data:
                    yield data
            yield encoder.close()
        except Exception:
            failed = True
            raise
        finally:
            await gen.aclose()
            # a client that left early pays for what was synthesised; an engine failure pays nothing
            await (ch.refund() if failed else ch.settle(samples / rate))

    headers = {"X-Sample-Rate": str(encoder.out_rate), "X-Model": name, "X-Voice": voice}  # (as encoded)
    if body.stream_format == "audio":
        return ClosingStreamingResponse(audio_bytes(), media_type=MEDIA_TYPES[fmt], headers=headers)

    async def events() -> AsyncIterator[str]:
        try:
            async for data in audio_bytes():
                if data:
                    yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report it in-band
            yield error_event(exc, "input", "synthesising")
            return
        u = req.usage
        usage = {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens}
        yield sse({"type": "speech.audio.done", "usage": {**usage, "total_tokens": u.input_tokens + u.output_tokens}})

    return ClosingStreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
