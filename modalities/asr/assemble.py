"""Per-window results → one ``Transcript``: the stitched text, its segments (one per window,
or subtitle cues), and the words and token logprobs the request asked for."""

from __future__ import annotations

from typing import Any

from modalities.asr.alignment import transcript_logprobs, transcript_words
from modalities.asr.longform import RATE, Window, meet_at_words, sentence_segments, window_segments
from modalities.asr.quality import WindowResult
from modalities.asr.types import Transcript, TranscriptionRequest


def assemble(
    req: TranscriptionRequest,
    windows: list[Window],
    texts: list[str],
    results: list[WindowResult],
    tokenizer: Any,
    first_special: int,
) -> Transcript:
    """The transcript of ``req``'s audio from its windows' texts and kept decodes
    (``first_special``: the first special token id, end-of-text)."""
    segments = window_segments(windows, texts, results)
    text = " ".join(s.text for s in segments)  # (the engine's text: cues are rebuilt from words)
    aligned = req.word_timestamps or req.sentence_segments
    words = transcript_words(windows, texts, results) if aligned else None
    if words:
        meet_at_words(segments, words)
    if words and req.sentence_segments:
        segments = sentence_segments(segments, words, lambda t: tokenizer(" " + t, add_special_tokens=False).input_ids)
    logprobs = transcript_logprobs(windows, texts, results, tokenizer, first_special) if req.logprobs else None
    heard = next((r.language for r in results if r.language and not r.silent), None)
    return Transcript(
        text,
        segments,
        req.language or heard or "en",
        len(req.audio) / RATE,
        words if req.word_timestamps else None,
        logprobs,
    )
