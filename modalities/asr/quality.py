"""Whisper's per-window quality checks: temperature fallback and silence (no-speech) skipping.

As ``whisper.transcribe`` does it: a window decoded at temperature ``t`` whose text is too
repetitive (gzip compression ratio > 2.4) or too unlikely (mean token logprob < -1.0) is decoded
again at ``t + 0.2``, ... up to 1.0 (when all fail, ``kept`` says which decode stands); a window
the model thinks silent (no-speech probability > 0.6)
and whose text is unlikely (mean logprob ≤ -1.0) is neither retried nor transcribed. And
mmserve's own: ``words_heard``, for whether a window's text stopped early (too few words a second).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

import numpy as np

from modalities.asr.types import Word

COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
TEMPERATURE_STEP = 0.2


def compression_ratio(text: str) -> float:
    """Whisper's repetition signal: raw bytes / zlib-compressed bytes (0 for no text)."""
    raw = text.encode()
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def fallback_temperatures(start: float) -> list[float]:
    """``start``, then ``start + 0.2``, ... while ≤ 1.0 (whisper's ``np.arange(t, 1 + 1e-6, 0.2)``)."""
    return [round(float(t), 6) for t in np.arange(start, 1.0 + 1e-6, TEMPERATURE_STEP)] or [start]


def avg_logprob(logprobs: list[float], num_text_tokens: int) -> float:
    """Whisper's ``sum_logprobs / (len(tokens) + 1)``: the sum covers the text tokens and the
    end-of-text token, the count the text tokens plus one."""
    return sum(logprobs) / (num_text_tokens + 1)


@dataclass
class WindowResult:
    """One decode attempt of one ≤30 s window."""

    text: str  # stripped
    tokens: list[int]  # text tokens, end-of-text excluded
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] | None = None  # window-relative, when word timestamps were asked for
    language: str | None = None  # the code of the language heard, when the request named none
    token_logprobs: list[float] = field(default_factory=list)  # of ``tokens``

    @property
    def silent(self) -> bool:
        """Whisper skips such a window: probably no speech, and the text is not trusted."""
        return self.no_speech_prob > NO_SPEECH_THRESHOLD and self.avg_logprob <= LOGPROB_THRESHOLD

    @property
    def needs_fallback(self) -> bool:
        """Decode again at the next temperature (never for a silent window)."""
        bad = self.compression_ratio > COMPRESSION_RATIO_THRESHOLD or self.avg_logprob < LOGPROB_THRESHOLD
        return bad and not self.silent


FALLBACK_KEEP = ("last", "best")


def check_fallback_keep(rule: str) -> str:
    if rule not in FALLBACK_KEEP:
        raise ValueError(f"fallback_keep must be one of {', '.join(FALLBACK_KEEP)}, got {rule!r}")
    return rule


def kept(attempts: list[WindowResult], rule: str = "last") -> WindowResult:
    """The decode a window keeps of its ``attempts`` (in temperature order): the last one, unless
    every attempt failed the checks and ``rule`` is ``"best"``: then the one with the best mean
    logprob among those not too repetitive, else among all (faster-whisper's rule). ``"last"``
    keeps the 1.0 sample, as ``whisper.transcribe`` and transformers' ``generate`` do."""
    last = attempts[-1]
    if rule == "last" or not last.needs_fallback:
        return last
    readable = [a for a in attempts if a.compression_ratio <= COMPRESSION_RATIO_THRESHOLD]
    return max(readable or attempts, key=lambda a: a.avg_logprob)


def passes_so_far(text: str, logprobs: list[float], no_speech_prob: float) -> bool:
    """Whether a window's live text may be streamed before the window ends: its running figures
    pass the checks and it cannot turn out silent. (A window can still fail at its end; the
    stream then stops sending deltas and its final event carries the text that was kept.)"""
    if no_speech_prob > NO_SPEECH_THRESHOLD or not logprobs:
        return False
    return (
        sum(logprobs) / len(logprobs) >= LOGPROB_THRESHOLD
        and compression_ratio(text.strip()) <= COMPRESSION_RATIO_THRESHOLD
    )


# Scripts written without spaces between words (kana, CJK ideographs, Thai, Lao, Myanmar, Khmer):
# their words are counted as characters over CHARS_PER_WORD (Chinese words average ~1.5).
_UNSPACED = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff]")
CHARS_PER_WORD = 1.5


def words_heard(text: str) -> float:
    """About how many words ``text`` holds: whitespace-separated words, and in scripts written
    without spaces, characters over ``CHARS_PER_WORD`` (else a window of Chinese would always
    look like one that stopped early, and pay an alignment pass: ``AsrEngine.decode_window``)."""
    unspaced = len(_UNSPACED.findall(text))
    return len(_UNSPACED.sub(" ", text).split()) + unspaced / CHARS_PER_WORD
