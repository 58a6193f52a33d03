"""Transcription response bodies: OpenAI's ``json``, ``text``, ``verbose_json``, ``srt``, ``vtt``."""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Sequence
from typing import Any

from modalities.asr.types import TokenLogprob, Transcript

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TIMESTAMP_GRANULARITIES = ("segment", "word")
INCLUDES = ("logprobs",)


def granularity_error(granularities: Sequence[str], response_format: str) -> str | None:
    """Why ``timestamp_granularities`` is refused, None when accepted: each ``segment`` or
    ``word``, and only with ``verbose_json``, as OpenAI requires (the endpoint and the job kind)."""
    for g in granularities:
        if g not in TIMESTAMP_GRANULARITIES:
            return f"timestamp_granularities must be 'segment' or 'word' (got {g!r})"
    if granularities and response_format != "verbose_json":
        return "timestamp_granularities requires response_format=verbose_json"
    return None


def include_error(include: Sequence[str], response_format: str) -> str | None:
    """Why ``include`` is refused, None when accepted: only ``logprobs``, and only with ``json``,
    as OpenAI requires (the endpoint and the job kind)."""
    for item in include:
        if item not in INCLUDES:
            return f"include may only hold 'logprobs' (got {item!r})"
    if include and response_format != "json":
        return "include logprobs requires response_format=json"
    return None


def shows_segments(response_format: str, granularities: Sequence[str] = ()) -> bool:
    """Whether the response holds segments (srt and vtt cues; verbose_json's, unless only words
    are asked for): they are then cut at sentences (``TranscriptionRequest.sentence_segments``)."""
    if response_format == "verbose_json":
        return not granularities or "segment" in granularities
    return response_format in ("srt", "vtt")


def _edge(c: str) -> bool:
    return unicodedata.category(c)[0] in "PS"  # punctuation, and symbols such as $ % ♪


def openai_word(word: str) -> str:
    """``word`` as OpenAI's ``words[].word`` has it: without what Whisper attached at either end
    (``"dog."`` -> ``dog``, ``"$500"`` -> ``500``), inner apostrophes and hyphens kept
    (``don't``, ``well-known``); "" for a word of punctuation alone. OpenAI's hosted whisper-1
    answers ``"text": "... beach volleyball."`` with ``{"word": "volleyball"}`` (its API reference)
    and ``"$500"`` with ``500`` (remotion-dev/remotion#4675)."""
    start, end = 0, len(word)
    while start < end and _edge(word[start]):
        start += 1
    while end > start and _edge(word[end - 1]):
        end -= 1
    return word[start:end]


def openai_words(t: Transcript) -> list[dict[str, Any]] | None:
    """``verbose_json``'s ``words`` (None when the transcript has no word timestamps): the
    engine's words in OpenAI's shape (``openai_word``), words of punctuation alone left out."""
    if t.words is None:
        return None
    return [{"word": text, "start": w.start, "end": w.end} for w in t.words if (text := openai_word(w.word))]


def usage(t: Transcript) -> dict[str, Any]:
    """What a transcription is billed: its audio's duration, in whole seconds (as OpenAI's)."""
    return {"type": "duration", "seconds": round(t.duration)}


def logprobs_field(logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
    """The ``logprobs`` field of a body or event, when the request asked for them (else none)."""
    return {} if logprobs is None else {"logprobs": [dataclasses.asdict(lp) for lp in logprobs]}


def to_json(t: Transcript) -> dict[str, Any]:
    """OpenAI's ``json`` body (and ``transcript.text.done``'s fields): the text, the tokens'
    ``logprobs`` when the request asked for them, the usage."""
    return {"text": t.text, **logprobs_field(t.logprobs), "usage": usage(t)}


def _clock(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(t: Transcript) -> str:
    blocks = [
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
        for i, s in enumerate(t.segments, start=1)
    ]
    return "\n".join(blocks)


def to_vtt(t: Transcript) -> str:
    blocks = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n" for s in t.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_verbose(t: Transcript, granularities: Sequence[str] = (), task: str = "transcribe") -> dict[str, Any]:
    """OpenAI's ``verbose_json``: Whisper's segment fields, with the per-window figures the
    engine measured (the kept decode's temperature, mean token logprob, compression ratio and
    the no-speech probability); ``words`` (``openai_words``) when the transcript has word
    timestamps. ``granularities`` with ``word`` but not ``segment`` leaves the segments out, as
    OpenAI does. ``language`` is a name as OpenAI gives it ("german"); a translation's is
    always "english", the language of its text."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    body: dict[str, Any] = {
        "task": task,
        "language": "english" if task == "translate" else LANGUAGES.get(t.language, t.language),
        "duration": round(t.duration, 3),
        "text": t.text,
    }
    words = openai_words(t)
    if words is not None:
        body["words"] = words
    if "segment" in granularities or "word" not in granularities:
        body["segments"] = [
            {
                "id": s.id,
                "seek": int(s.start * 100),  # in 10 ms mel frames, as Whisper counts
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in t.segments
        ]
    body["usage"] = usage(t)
    return body
