"""The ASR engine's picklable request and result types (they cross the Celery dispatch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def whisper_languages() -> frozenset[str]:
    """The language codes Whisper knows ("en", "de", ...: what a multilingual model may be asked)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return frozenset(LANGUAGES)


def check_asr_language(asr: Any, language: str) -> None:
    """``ValueError`` for a ``language`` the ASR engine cannot be asked: its model's own check
    where the engine is local (``AsrEngine.prompt_ids``). A model in another process is not asked:
    only what no Whisper takes is refused there (an English-only one also takes "english")."""
    check = getattr(asr, "prompt_ids", None)
    if check is not None:
        check(language)
    elif language.lower() not in whisper_languages() | {"english"}:
        raise ValueError(f"unsupported language {language!r}")


@dataclass
class Segment:
    """One window's text (after stitching) with Whisper's per-window figures: the temperature of
    the kept decode, its mean token logprob and compression ratio, and the no-speech probability."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    avg_logprob: float = 0.0
    temperature: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


@dataclass
class Word:
    """One word of the transcript (punctuation attached as in the text: ``text.split()``; the
    OpenAI responses drop it, see ``formats.openai_word``), times in seconds."""

    word: str
    start: float
    end: float


@dataclass
class TokenLogprob:
    """One token of the transcript's text as OpenAI's ``logprobs`` list it: the token's text
    (a piece of a character decodes to U+FFFD), the logprob of its choice, its UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


@dataclass
class Transcript:
    """``words``: set (possibly empty) when the request asked for word timestamps, else None;
    ``logprobs``: the text's tokens, when the request asked for them (``TranscriptionRequest.logprobs``)."""

    text: str
    segments: list[Segment]
    language: str
    duration: float
    words: list[Word] | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class TranscriptionRequest:
    """What ``run``/``stream`` take (picklable): 16 kHz mono float32 audio plus options.
    ``language``: None = English for an English-only model, else detected once, in the first
    window encoded (per window with ``AsrConfig.language_per_window``).
    ``vad``: None = windows of speech for audio longer than one window, a shorter clip whole
    unless it holds no speech at all; True = windows of speech; False = the audio as it is.
    ``temperature``: the first decode's;
    fallbacks go up from it. ``seed``: of the sampled (temperature > 0) decodes (None: 0).
    ``word_timestamps``: also align every word (one extra decoder pass per window).
    ``sentence_segments``: segments cut at sentence ends and pauses (``longform.sentence_segments``:
    subtitle cues), at the words' times (the same extra pass), not one per window.
    ``logprobs``: the transcript carries its tokens' logprobs (those of the decodes kept, of the
    words the stitch kept).
    ``priority``: lower is encoded and admitted to the decoder first; a window of priority < 0
    (``engine.foreground.INTERACTIVE``: a live voice turn) is encoded alone on a CPU
    (``modalities.asr.encoder``)."""

    audio: np.ndarray
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    vad: bool | None = None
    seed: int | None = None
    word_timestamps: bool = False
    sentence_segments: bool = False
    task: str = "transcribe"  # or "translate" (to English; a multilingual model only)
    priority: int = 0
    logprobs: bool = False
    refusable: bool = False  # the engine may refuse it (``HeldBoundError``) when busy: the routes' requests


@dataclass
class TranscriptDelta:
    """A streamed piece: ``text`` to append (with its tokens' ``logprobs`` when the request
    asked for them); the last one has ``transcript`` set."""

    text: str
    transcript: Transcript | None = None
    logprobs: list[TokenLogprob] | None = None
