"""Per-window results → one ``Transcript``: the stitched text, its segments (one per window,
or subtitle cues), and the words and token logprobs the request asked for; and the token
logprobs of a transcription stream's deltas, and what the stream has heard so far."""

from __future__ import annotations

from typing import Any

from modalities.asr.alignment import span_logprobs, transcript_logprobs, transcript_words
from modalities.asr.longform import (
    RATE,
    Window,
    meet_at_words,
    sentence_segments,
    stable_spans,
    stable_text,
    window_segments,
)
from modalities.asr.quality import WindowResult
from modalities.asr.types import TokenLogprob, Transcript, TranscriptDelta, TranscriptionRequest

Decoded = tuple[list[int], list[float]]  # a decode's tokens so far, and their logprobs


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


class DeltaLogprobs:
    """The token logprobs of each delta of one transcription stream (OpenAI's
    ``transcript.text.delta`` ``logprobs``): the tokens of the stable prefix (``stable_spans``)
    not yet sent, and at the end the rest of the transcript's. Sent in order, they add up to the
    transcript's ``logprobs``; a window whose live tokens do not spell its text (not seen so far) holds
    back its tokens and those after it until a later delta or the final transcript."""

    def __init__(self, tokenizer: Any, first_special: int) -> None:
        self.tokenizer, self.first_special = tokenizer, first_special
        self.sent = 0
        self._done: dict[tuple[int, int, int], list[TokenLogprob] | None] = {}  # a finished window's spans

    def of_stable(
        self, windows: list[Window], texts: list[str], done: list[bool], decoded: list[Decoded]
    ) -> list[TokenLogprob]:
        """The unsent logprobs of the stable prefix of windows' ``texts`` (``decoded``: each
        window's tokens, live or kept)."""
        out: list[TokenLogprob] = []
        for i, lo, hi in stable_spans(windows, texts, done):
            if done[i] and (i, lo, hi) in self._done:  # (a long file's many windows: once each)
                lps = self._done[i, lo, hi]
            else:
                lps = span_logprobs(self.tokenizer, *decoded[i], texts[i], lo, hi, self.first_special)
                if done[i]:
                    self._done[i, lo, hi] = lps
            if lps is None:
                break
            out += lps
        return self._unsent(out)

    def rest(self, transcript: Transcript) -> list[TokenLogprob]:
        """The transcript's logprobs not yet sent."""
        return self._unsent(transcript.logprobs or [])

    def _unsent(self, lps: list[TokenLogprob]) -> list[TokenLogprob]:
        new = lps[self.sent :]
        self.sent = max(self.sent, len(lps))
        return new


class TranscriptSoFar:
    """One transcription stream's windows as they decode (``AsrEngine.stream``): each update
    (a window's live text, or its kept decode) may give a delta of the stable prefix
    (``stable_text``); ``finish`` assembles the transcript once every window is done."""

    def __init__(self, req: TranscriptionRequest, windows: list[Window], tokenizer: Any, first_special: int) -> None:
        self.req, self.windows = req, windows
        self.tokenizer, self.first_special = tokenizer, first_special
        self.texts = [""] * len(windows)
        self.results: list[WindowResult | None] = [None] * len(windows)
        self.done = [False] * len(windows)
        self.decoded: list[Decoded] = [([], [])] * len(windows)
        self.logprobs = DeltaLogprobs(tokenizer, first_special) if req.logprobs else None
        self.emitted = ""

    @property
    def complete(self) -> bool:
        return all(self.done)

    def update(self, i: int, text: str, result: WindowResult | None, decoded: Decoded) -> TranscriptDelta | None:
        """Window ``i``'s live ``text`` (``result`` None) or its kept decode: the new stable text."""
        self.texts[i], self.decoded[i] = text, decoded
        if result is not None:
            self.results[i], self.done[i] = result, True
        stable = stable_text(self.windows, self.texts, self.done)
        if not (stable.startswith(self.emitted) and len(stable) > len(self.emitted)):
            return None
        lps = self.logprobs.of_stable(self.windows, self.texts, self.done, self.decoded) if self.logprobs else None
        delta = TranscriptDelta(stable[len(self.emitted) :], logprobs=lps)
        self.emitted = stable
        return delta

    def finish(self) -> list[TranscriptDelta]:
        """The rest of the text, if any, then the item carrying the ``Transcript``."""
        results = [r for r in self.results if r is not None]
        assert len(results) == len(self.windows)  # (every window is done)
        transcript = assemble(self.req, self.windows, self.texts, results, self.tokenizer, self.first_special)
        out = []
        if transcript.text.startswith(self.emitted) and len(transcript.text) > len(self.emitted):
            lps = self.logprobs.rest(transcript) if self.logprobs else None
            out.append(TranscriptDelta(transcript.text[len(self.emitted) :], logprobs=lps))
        return [*out, TranscriptDelta("", transcript)]
