"""OpenAI-compatible ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` (multipart).

Fields: ``file`` (wav, flac, ogg, mp3, or anything PyAV decodes), ``model`` (optional when one
ASR model is served), ``language``, ``prompt``, ``temperature`` (0..1: the first decode's; a
window failing Whisper's checks is decoded again at +0.2 steps up to 1), ``seed`` (mmserve's
extension: seeds those sampled decodes, default 0, so a request is reproducible),
``response_format`` (json, text, verbose_json, srt, vtt), ``timestamp_granularities[]``
(``segment`` and/or ``word``, with verbose_json only, as OpenAI: ``word`` adds a top-level
``words`` list of ``{word, start, end}``, aligned from Whisper's cross-attention, each word
without the punctuation around it as OpenAI's; ``word`` alone leaves ``segments`` out, as OpenAI
does), ``stream`` (SSE: ``transcript.text.delta``
events as text decodes, then ``transcript.text.done``, whose text is the final one (it differs
from the deltas' where a window's decode failed Whisper's checks at its end); json/text
only, so never with word timestamps), ``include[]`` (``logprobs``, with json only, as OpenAI:
the response's ``logprobs`` lists the text's tokens, each ``{token, logprob, bytes}``; a stream
gives each delta's tokens with it, and them all in ``transcript.text.done``); the two list fields
are also read without their brackets. Unreadable audio is a 400, a file over the ASR upload
limit (``--asr-max-file-mb``, default 25 MB as OpenAI) a 413. Each request is charged its audio
duration in ``audio_seconds`` against the tenant's rate limit (refunded when it fails). Without
``language``, an English-only model hears English and a multilingual one the language it detects
in the first window encoded (reported in verbose_json).

Translations (speech in any language the model knows, as English text) take ``file``, ``model``,
``prompt``, ``response_format`` and ``temperature`` as OpenAI's; they need a multilingual Whisper
(``--asr base``): an English-only one answers 400 naming ``model``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.errors import QueueFullError
from gateway.errors import APIError, as_api_error, pick_engine
from gateway.metrics import engine_modality
from gateway.streaming import SSE_HEADERS, ClosingStreamingResponse, charged, error_event, sse
from modalities.asr.engine import DEFAULT_MAX_FILE_MB
from modalities.asr.formats import (
    RESPONSE_FORMATS,
    granularity_error,
    include_error,
    logprobs_field,
    shows_segments,
    to_json,
    to_srt,
    to_verbose,
    to_vtt,
)
from modalities.asr.types import check_asr_language
from modalities.audio import ASR_RATE, MAX_AUDIO_S, AudioDecodeError, AudioTooLong, decode_audio

router = APIRouter(tags=["audio"])
T = TypeVar("T")


def pick_asr_engine(engines: dict[str, Any], aliases: dict[str, str], model: str | None) -> tuple[str, Any]:
    """``(served_name, engine)`` among the served ASR engines (``model`` optional when one is)."""
    asr = {name: e for name, e in engines.items() if engine_modality(e) == "asr"}
    return pick_engine(
        engines,
        aliases,
        model or None,  # an empty form field counts as omitted
        asr,
        none_served="no speech-to-text model is served (include asr in --only; --asr picks the model)",
        unsupported="does not support transcription",
    )


def resolve_asr_engine(request: Request, model: str | None) -> tuple[str, Any]:
    return pick_asr_engine(request.app.state.engines, getattr(request.app.state, "aliases", {}), model)


def _check_options(response_format: str, temperature: float) -> None:
    if response_format not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}", param="response_format")
    if not 0.0 <= temperature <= 1.0:
        raise APIError(400, f"temperature must be in [0, 1], got {temperature}", param="temperature")


MIN_AUDIO_S = 0.1  # OpenAI's minimum


def check_model_can(served: str, engine: Any, language: str | None, task: str = "transcribe") -> None:
    """400 for what the model cannot do, before any audio is read: translating on an English-only
    model (naming ``model``), a language it does not take (naming ``language``; see
    ``check_asr_language`` for a model in another process, which says the rest where it runs)."""
    if task == "translate" and getattr(engine, "multilingual", None) is False:
        raise APIError(400, f"model {served} is English-only: it cannot translate", param="model")
    if language:
        try:
            check_asr_language(engine, language)
        except ValueError as exc:
            raise APIError(400, str(exc), param="language") from exc


def check_duration(duration: float) -> None:
    """400 ``audio_too_short`` under ``MIN_AUDIO_S`` (as OpenAI's: nothing to hear in less)."""
    if duration < MIN_AUDIO_S:
        raise APIError(
            400,
            f"audio file is too short: {duration * 1000:.0f} ms; the minimum is {MIN_AUDIO_S * 1000:.0f} ms",
            param="file",
            code="audio_too_short",
        )


async def _read_audio(file: UploadFile, engine: Any) -> Any:
    """The upload decoded to 16 kHz mono (``modalities.audio.DecodedAudio``); a 413 past the
    engine's file or duration limit, a 400 for what no decoder reads; first a 429 when the engine
    has no room for the request (its ``reserve``, held while decoding; an engine in another
    process has none and refuses there), so that a burst past the bound is refused undecoded."""
    try:
        with getattr(engine, "reserve", contextlib.nullcontext)():
            return await _decoded(file, engine)
    except QueueFullError as exc:
        raise as_api_error(exc) from exc


async def _decoded(file: UploadFile, engine: Any) -> Any:
    limit_mb = float(getattr(engine, "max_file_mb", DEFAULT_MAX_FILE_MB))
    data = await file.read(int(limit_mb * (1 << 20)) + 1)
    if len(data) > limit_mb * (1 << 20):
        raise APIError(413, f"the audio file exceeds the {limit_mb:g} MiB limit", param="file", code="file_too_large")
    max_s = float(getattr(engine, "max_audio_s", MAX_AUDIO_S))
    try:
        audio = await asyncio.to_thread(decode_audio, data, ASR_RATE, max_s)
    except AudioTooLong as exc:
        raise APIError(413, str(exc), param="file", code="audio_too_long") from exc
    except AudioDecodeError as exc:
        raise APIError(400, f"could not read the audio file: {exc}", param="file", code="invalid_audio") from exc
    check_duration(audio.duration)
    return audio


async def _charged(request: Request, duration: float, bad_option: str, work: Callable[[], Awaitable[T]]) -> T:
    """``work()`` charged ``duration`` audio seconds against the tenant (``gateway.streaming.
    charged``: refunded when it fails, cancelled when the client leaves); a ``ValueError`` (what
    the model can't do) is a 400 naming ``bad_option``."""
    try:
        return await charged(request, "audio_seconds", duration, work)
    except Exception as exc:
        raise as_api_error(exc, bad_option if isinstance(exc, ValueError) else "file") from exc


def _response(transcript: Any, response_format: str, granularities: list[str], task: str = "transcribe") -> Any:
    if response_format == "text":
        return PlainTextResponse(transcript.text + "\n")
    if response_format == "srt":
        return PlainTextResponse(to_srt(transcript))
    if response_format == "vtt":
        return PlainTextResponse(to_vtt(transcript), media_type="text/vtt")
    if response_format == "verbose_json":
        return JSONResponse(to_verbose(transcript, granularities, task))
    return JSONResponse(to_json(transcript))


@router.post("/v1/audio/transcriptions")
async def create_transcription(
    request: Request,
    file: Annotated[UploadFile, File()],
    model: Annotated[str | None, Form()] = None,
    language: Annotated[str | None, Form()] = None,
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,
    stream: Annotated[bool, Form()] = False,
    seed: Annotated[int | None, Form()] = None,
    timestamp_granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
    include: Annotated[list[str] | None, Form(alias="include[]")] = None,
    # (the same fields named without brackets, as a hand-written form may: not to be ignored)
    granularities_plain: Annotated[list[str] | None, Form(alias="timestamp_granularities")] = None,
    include_plain: Annotated[list[str] | None, Form(alias="include")] = None,
) -> Any:
    """OpenAI ``POST /v1/audio/transcriptions``."""
    from modalities.asr.engine import TranscriptionRequest

    _check_options(response_format, temperature)
    if stream and response_format not in ("json", "text"):
        raise APIError(400, "stream=true supports response_format json or text", param="stream")
    granularities = [*(timestamp_granularities or []), *(granularities_plain or [])]
    include = [*(include or []), *(include_plain or [])]
    if error := granularity_error(granularities, response_format):
        raise APIError(400, error, param="timestamp_granularities[]")
    words = "word" in granularities
    if seed is not None and not 0 <= seed < 1 << 32:
        raise APIError(400, f"seed must be in [0, 2**32), got {seed}", param="seed")
    if error := include_error(include, response_format):
        raise APIError(400, error, param="include[]")
    served, engine = resolve_asr_engine(request, model)
    check_model_can(served, engine, language or None)
    audio = await _read_audio(file, engine)
    req = TranscriptionRequest(
        audio.samples,
        language or None,
        prompt or None,
        temperature,
        seed=seed,
        word_timestamps=words,
        sentence_segments=shows_segments(response_format, granularities),
        logprobs=bool(include),
        refusable=True,
    )
    if not stream:
        transcript = await _charged(request, audio.duration, "language", lambda: engine.run(req))
        return _response(transcript, response_format, granularities)
    deltas = engine.stream(req)
    # The first item before the status line: admission errors become a status code, not a broken stream.
    first = await _charged(request, audio.duration, "language", lambda: anext(deltas, None))
    return ClosingStreamingResponse(_sse(first, deltas), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/audio/translations")
async def create_translation(
    request: Request,
    file: Annotated[UploadFile, File()],
    model: Annotated[str | None, Form()] = None,
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,
) -> Any:
    """OpenAI ``POST /v1/audio/translations``: the speech as English text (Whisper's translate task)."""
    from modalities.asr.engine import TranscriptionRequest

    _check_options(response_format, temperature)
    served, engine = resolve_asr_engine(request, model)
    check_model_can(served, engine, None, "translate")
    audio = await _read_audio(file, engine)
    cues = shows_segments(response_format)
    req = TranscriptionRequest(
        audio.samples, None, prompt or None, temperature, task="translate", sentence_segments=cues, refusable=True
    )
    transcript = await _charged(request, audio.duration, "model", lambda: engine.run(req))
    return _response(transcript, response_format, [], "translate")


async def _sse(first: Any, deltas: AsyncIterator[Any]) -> AsyncIterator[str]:
    """OpenAI's transcription stream events; closing it (client gone) aborts the decode."""
    try:
        item = first
        while item is not None:
            if item.transcript is not None:
                yield sse({"type": "transcript.text.done", **to_json(item.transcript)})
            elif item.text or item.logprobs:
                yield sse({"type": "transcript.text.delta", "delta": item.text, **logprobs_field(item.logprobs)})
            item = await anext(deltas, None)
    except Exception as exc:  # noqa: BLE001 - the status line is gone: report it in-band
        yield error_event(exc, "file", "transcribing")
    finally:
        await deltas.aclose()
