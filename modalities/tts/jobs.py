"""Job kind ``speech.generate`` (queue ``mmserve.tts``): long text to one audio file.

``params`` is a ``/v1/audio/speech`` body whose ``input`` may run to ``MAX_JOB_CHARS`` (a book
chapter rather than a reply). The text is synthesised in segments of at most ``SEGMENT_CHARS``
on the same engines as the online route; progress is characters done of the total, cancelling
the job closes the stream (which stops the engine work), and the encoded file goes to the result
store as ``speech.<response_format>``; a text the voice made no audio of at all fails the job with
the route's 400 message. A submission is charged the route's ``audio_seconds`` estimate for the
whole text.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from workers.jobs import JobCancelled, JobContext, ParamError, parse_params, register_job_kind

KIND = "speech.generate"
MAX_JOB_CHARS = 200_000
SEGMENT_CHARS = 1000


def _parse(params: dict[str, Any]) -> Any:
    from modalities.tts.protocol import SpeechRequest

    body = parse_params(SpeechRequest, params)  # (a 400 at submit)
    if not body.input.strip():
        raise ParamError("input", "must be a non-empty string")
    if len(body.input) > MAX_JOB_CHARS:
        raise ParamError("input", f"{len(body.input)} characters; the maximum for a job is {MAX_JOB_CHARS}")
    return body


def segments(text: str, size: int = SEGMENT_CHARS) -> list[str]:
    """Consecutive groups of whole text pieces, each at most ``size`` characters (``size`` >= the
    splitter's ``max_chars``)."""
    from modalities.tts.text import split_text

    out: list[str] = []
    for piece in split_text(text, max_chars=min(300, size)):
        if out and len(out[-1]) + 1 + len(piece) <= size:
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


def validate(params: dict[str, Any], engines: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """400 before queueing: bad body, unknown model or voice, speed the backend cannot do. The
    model resolves as on the route (aliases too); the stored params name the served model, so a
    worker, which knows no aliases, finds it."""
    from modalities.tts.base import check_request
    from modalities.tts.protocol import TTSInputError, TTSRequest
    from modalities.tts.registry import resolve_tts

    body = _parse(params)
    name, engine, voice = resolve_tts(engines, body.model, body.voice, aliases)
    try:
        check_request(engine, TTSRequest("x", voice, body.speed, body.sample_rate))
    except TTSInputError as exc:
        raise ParamError(exc.param, str(exc)) from None
    return {**params, "model": name}


def cost(params: dict[str, Any], engines: dict[str, Any]) -> tuple[str, float]:
    """``audio_seconds`` estimated from the text, as the online route admits (not settled later:
    the job may run on another process)."""
    from modalities.tts.api import estimate_seconds

    body = _parse(params)
    return "audio_seconds", estimate_seconds(body.input, body.speed)


async def run(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    from modalities.audio import MEDIA_TYPES, StreamEncoder
    from modalities.tts.api import nothing_to_speak
    from modalities.tts.protocol import PCM_RATE, TTSRequest
    from modalities.tts.registry import resolve_tts

    body = _parse(params)
    name, engine, voice = resolve_tts(ctx.engines, body.model, body.voice, ctx.aliases)
    fmt = body.response_format
    rate = body.sample_rate or (PCM_RATE if fmt == "pcm" else engine.sample_rate)
    encoder = StreamEncoder(fmt, rate)
    data = bytearray()
    samples = done = 0
    parts = segments(body.input)
    total = sum(len(p) for p in parts)
    for part in parts:
        async with aclosing(engine.stream(TTSRequest(part, voice, body.speed, rate))) as chunks:
            async for chunk in chunks:
                if ctx.cancelled:
                    raise JobCancelled(f"job {ctx.job_id} was cancelled")
                data += encoder.encode(chunk)
                samples += chunk.size
        done += len(part)
        ctx.progress(done, total)
    if not samples:  # (the route's 400 for it: not refused at submit, as only the voice knows)
        raise nothing_to_speak()
    data += encoder.close()
    url = ctx.store.put(ctx.job_id, f"speech.{fmt}", bytes(data), MEDIA_TYPES[fmt])
    return {"url": url, "model": name, "voice": voice, "format": fmt, "sample_rate": rate, "seconds": samples / rate}


def register() -> None:
    register_job_kind(KIND, "tts", run, validate=validate, concurrency=4, cost=cost)
