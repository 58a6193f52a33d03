"""Job kind ``audio.transcription`` (queue ``mmserve.asr``): a long uploaded recording to a
transcript file.

``params``: ``file_id`` (an audio file uploaded through ``POST /v1/files``), and optionally
``model``, ``language``, ``prompt``, ``temperature``, ``seed``, ``response_format`` (default
verbose_json), ``timestamp_granularities`` (``segment`` and/or ``word``, verbose_json only), as
the online route: ``word`` puts OpenAI's ``words`` in the verbose_json transcript; ``include``
(``logprobs``, json only: the tokens' logprobs in the json transcript; not with ``translate``);
and ``task``: ``transcribe`` (default) or ``translate`` (English text, as
``/v1/audio/translations``: a multilingual model only). A list given as null is left out. The
model, and the language and task it can do, are checked at submit as the online routes check them.
The transcript goes to the result store as ``transcript.<ext>``; the job result also carries the
text, duration and segment count (and the word count when words were asked for). Cancelling the
job closes the transcription stream, which aborts its decodes in the engine.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from workers.jobs import JobCancelled, JobContext, ParamError, parse_params, register_job_kind

KIND = "audio.transcription"
_EXT = {"json": "json", "verbose_json": "json", "text": "txt", "srt": "srt", "vtt": "vtt"}
_TYPES = {"json": "application/json", "txt": "text/plain", "srt": "application/x-subrip", "vtt": "text/vtt"}


class TranscriptionJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file_id: str = Field(min_length=1, max_length=300)
    model: str | None = None
    language: str | None = None
    prompt: str | None = Field(default=None, max_length=4000)
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 32)
    response_format: Literal["json", "text", "verbose_json", "srt", "vtt"] = "verbose_json"
    timestamp_granularities: list[str] = Field(default_factory=list)
    include: list[str] = Field(default_factory=list)
    task: Literal["transcribe", "translate"] = "transcribe"

    @field_validator("timestamp_granularities", "include", mode="before")
    @classmethod
    def _null_is_none(cls, value: Any) -> Any:
        return [] if value is None else value  # (as an optional field left out)

    @field_validator("temperature", "seed", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would take true as 1 (the speech body refuses it too)
            raise ValueError("must be a number, not a boolean")
        return value


def validate(params: dict[str, Any], engines: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """400 (or the route's 404) before queueing: bad fields, and the model, language and task as
    the online routes check them (under celery the gateway's engines are remote ones with the
    same names). The stored params name the served model, so a worker, which knows no aliases,
    finds it."""
    from modalities.asr.api import check_model_can, pick_asr_engine
    from modalities.asr.formats import granularity_error, include_error

    job = parse_params(TranscriptionJob, params)
    if error := granularity_error(job.timestamp_granularities, job.response_format):
        raise ParamError("timestamp_granularities", error)
    if error := include_error(job.include, job.response_format):
        raise ParamError("include", error)
    if job.include and job.task == "translate":  # (as /v1/audio/translations, which has no include)
        raise ParamError("include", "the translate task has no include")
    name, engine = pick_asr_engine(engines, aliases, job.model)
    check_model_can(name, engine, job.language, job.task)
    return {**job.model_dump(), "model": name}


# What a job's audio is charged before it is decoded (the gateway does not read the file): its size
# as 16 kHz 16-bit mono PCM, what Whisper consumes (compressed uploads are charged less than they last).
BYTES_PER_AUDIO_SECOND = 32_000


def cost(params: dict[str, Any], engines: dict[str, Any], file_bytes: int = 0) -> tuple[str, float]:
    """``audio_seconds`` estimated from the size of ``params.file_id`` (see ``BYTES_PER_AUDIO_SECOND``)."""
    return "audio_seconds", file_bytes / BYTES_PER_AUDIO_SECOND


def render(transcript: Any, fmt: str, granularities: list[str] | None = None, task: str = "transcribe") -> bytes:
    from modalities.asr.formats import to_json, to_srt, to_verbose, to_vtt

    if fmt == "verbose_json":
        return json.dumps(to_verbose(transcript, granularities or (), task)).encode()
    if fmt == "json":
        return json.dumps(to_json(transcript)).encode()
    return {"text": transcript.text + "\n", "srt": to_srt(transcript), "vtt": to_vtt(transcript)}[fmt].encode()


async def run(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    from modalities.asr.api import check_duration, pick_asr_engine
    from modalities.asr.engine import TranscriptionRequest
    from modalities.asr.formats import openai_words, shows_segments
    from modalities.audio import ASR_RATE, MAX_AUDIO_S, decode_audio
    from workers.jobs.store import parse_file_id

    job = TranscriptionJob(**params)
    name, engine = pick_asr_engine(ctx.engines, ctx.aliases, job.model)
    data, _ = await asyncio.to_thread(ctx.store.get, *parse_file_id(job.file_id))
    max_s = float(getattr(engine, "max_audio_s", MAX_AUDIO_S))
    decoded = await asyncio.to_thread(decode_audio, data, ASR_RATE, max_s)
    check_duration(decoded.duration)  # (the gateway does not read the file: the route's 400 fails the job)
    audio = decoded.samples
    words = "word" in job.timestamp_granularities
    req = TranscriptionRequest(
        audio,
        job.language,
        job.prompt,
        job.temperature,
        seed=job.seed,
        word_timestamps=words,
        task=job.task,
        sentence_segments=shows_segments(job.response_format, job.timestamp_granularities),
        logprobs=bool(job.include),
    )
    transcript = None
    ctx.progress(0, 1)
    async with aclosing(engine.stream(req)) as deltas:
        async for delta in deltas:
            if ctx.cancelled:
                raise JobCancelled(f"job {ctx.job_id} was cancelled")
            transcript = delta.transcript or transcript
    assert transcript is not None
    ext = _EXT[job.response_format]
    url = await asyncio.to_thread(
        ctx.store.put,
        ctx.job_id,
        f"transcript.{ext}",
        render(transcript, job.response_format, job.timestamp_granularities, job.task),
        _TYPES[ext],
    )
    ctx.progress(1, 1)
    result: dict[str, Any] = {
        "url": url,
        "model": name,
        "text": transcript.text,
        "duration": transcript.duration,
        "segments": len(transcript.segments),
    }
    if words:  # the words themselves are in the transcript file, as the segments are
        result["words"] = len(openai_words(transcript) or [])
    return result


def register() -> None:
    register_job_kind(KIND, "asr", run, validate=validate, concurrency=2, cost=cost)
