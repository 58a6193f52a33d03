"""Transcription response bodies: OpenAI's ``json``, ``text``, ``verbose_json``, ``srt``, ``vtt``."""

from __future__ import annotations

from typing import Any

from modalities.asr.engine import Transcript

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


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


def to_verbose(t: Transcript, segments: bool = True) -> dict[str, Any]:
    """OpenAI's ``verbose_json``: Whisper's segment fields, with the per-window figures the
    engine measured (the kept decode's temperature, mean token logprob, compression ratio and
    the no-speech probability); ``words`` when the transcript has word timestamps. ``segments``
    False leaves them out (OpenAI's answer to ``timestamp_granularities=["word"]``)."""
    body: dict[str, Any] = {
        "task": "transcribe",
        "language": {"en": "english"}.get(t.language, t.language),
        "duration": round(t.duration, 3),
        "text": t.text,
    }
    if t.words is not None:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in t.words]
    if segments:
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
    body["usage"] = {"type": "duration", "seconds": round(t.duration)}
    return body
