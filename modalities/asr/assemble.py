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
    transcript's ``logprobs``: a window whose tokens do not spell its text is left out of both
    (``span_logprobs``). What was sent is counted in bytes: a fallback decode that says the same
    words may split them into other tokens."""

    def __init__(self, tokenizer: Any, first_special: int) -> None:
        self.tokenizer, self.first_special = tokenizer, first_special
        self.sent_bytes = 0
        # A finished window's span: its tokens and their byte count (a long file's many windows: once each).
        self._done: dict[tuple[int, int, int], tuple[list[TokenLogprob], int] | None] = {}

    def of_stable(
        self, spans: list[tuple[int, int, int]], texts: list[str], done: list[bool], decoded: list[Decoded]
    ) -> list[TokenLogprob]:
        """The unsent logprobs of the stable prefix ``spans`` of windows' ``texts`` (``decoded``:
        each window's tokens, live or kept)."""
        return self._unsent(self._parts(spans, texts, done, decoded))

    def rebase(
        self, spans: list[tuple[int, int, int]], texts: list[str], done: list[bool], decoded: list[Decoded]
    ) -> None:
        """Count the tokens of ``spans`` as sent, whatever was (``TranscriptSoFar._rebase``)."""
        self.sent_bytes = sum(size for _, size in self._parts(spans, texts, done, decoded))

    def _parts(
        self, spans: list[tuple[int, int, int]], texts: list[str], done: list[bool], decoded: list[Decoded]
    ) -> list[tuple[list[TokenLogprob], int]]:
        parts = []
        for i, lo, hi in spans:
            if done[i] and (i, lo, hi) in self._done:
                part = self._done[i, lo, hi]
            else:
                lps = span_logprobs(self.tokenizer, *decoded[i], texts[i], lo, hi, self.first_special)
                part = None if lps is None else _sized(lps)
                if done[i]:
                    self._done[i, lo, hi] = part
            if part is not None:
                parts.append(part)
        return parts

    def rest(self, transcript: Transcript) -> list[TokenLogprob]:
        """The transcript's logprobs not yet sent."""
        return self._unsent([_sized(transcript.logprobs or [])])

    def _unsent(self, parts: list[tuple[list[TokenLogprob], int]]) -> list[TokenLogprob]:
        new: list[TokenLogprob] = []
        at = 0
        for lps, size in parts:
            if at + size <= self.sent_bytes:
                at += size
                continue
            for lp in lps:
                if at >= self.sent_bytes:
                    new.append(lp)
                at += len(lp.bytes)
        self.sent_bytes = max(self.sent_bytes, at)
        return new


def _sized(lps: list[TokenLogprob]) -> tuple[list[TokenLogprob], int]:
    """``lps`` and the bytes they hold."""
    return lps, sum(len(lp.bytes) for lp in lps)


def _extends(text: str, prefix: str) -> bool:
    """Whether ``text`` adds words to ``prefix`` (not letters to its last word: a fallback
    decode's "category" after a sent "cat")."""
    return len(text) > len(prefix) and text.startswith(prefix) and (not prefix or text[len(prefix)].isspace())


class TranscriptSoFar:
    """One transcription stream's windows as they decode (``AsrEngine.stream``): each update
    (a window's live text, or its kept decode) may give a delta of the stable prefix
    (``stable_text``); ``finish`` assembles the transcript once every window is done.

    A window whose live text went out may be decoded again (it failed the checks at its end) and
    say something else: the client keeps the words it has, and the stream goes on after as many
    words of the kept decode (``_rebase``), so the deltas differ from the done text there only."""

    def __init__(self, req: TranscriptionRequest, windows: list[Window], tokenizer: Any, first_special: int) -> None:
        self.req, self.windows = req, windows
        self.tokenizer, self.first_special = tokenizer, first_special
        self.texts = [""] * len(windows)
        self.results: list[WindowResult | None] = [None] * len(windows)
        self.done = [False] * len(windows)
        self.decoded: list[Decoded] = [([], [])] * len(windows)
        self.logprobs = DeltaLogprobs(tokenizer, first_special) if req.logprobs else None
        self.emitted = ""  # the stable text the client has (after a rebase: as many words of it)
        self.said = False  # whether any text went out (a rebase may leave ``emitted`` empty)
        self.sent: tuple[int, int] | None = None  # the last window the client has words of, and how many
        # After a window was decoded again: the client has this many words from that window on,
        # of other decodes; until the stable text holds as many, it is all the client has.
        self.cap: tuple[int, int] | None = None

    @property
    def complete(self) -> bool:
        return all(self.done)

    def update(self, i: int, text: str, result: WindowResult | None, decoded: Decoded) -> TranscriptDelta | None:
        """Window ``i``'s live ``text`` (``result`` None) or its kept decode: the new stable text."""
        self.texts[i], self.decoded[i] = text, decoded
        if result is not None:
            self.results[i], self.done[i] = result, True
        spans = stable_spans(self.windows, self.texts, self.done)
        stable = stable_text(self.texts, spans)
        diverged = stable != self.emitted and not _extends(stable, self.emitted)
        if diverged and self.cap is None and self.sent is not None and self.done[self.sent[0]]:
            self.cap = self.sent
        if self.cap is not None:
            self._rebase(spans)
        if not _extends(stable, self.emitted):
            return None
        lps = self.logprobs.of_stable(spans, self.texts, self.done, self.decoded) if self.logprobs else None
        delta = TranscriptDelta(self._past_emitted(stable), logprobs=lps)
        self.emitted, self.said = stable, True
        self.sent = (spans[-1][0], spans[-1][2] - spans[-1][1])
        return delta

    def _rebase(self, spans: list[tuple[int, int, int]]) -> None:
        """The client's words from window ``cap[0]`` on are of decodes since replaced: as many
        words of the stable text count as sent (up to the end of that window and of any that
        overlap it in a chain), so the stream goes on after them (for good, once the stable
        text holds them)."""
        assert self.cap is not None
        last, left = self.cap
        upto = []
        for i, lo, hi in spans:
            if i > last and not self.windows[i].overlaps_prev:
                left = 0  # (the client's words were of audio before this window: only a stitch moves words)
            if i >= last:
                hi = min(hi, lo + left)
                left -= hi - lo
            upto.append((i, lo, hi))
            if i >= last and not left:
                self.cap = None
                break
        self.emitted = stable_text(self.texts, upto)
        if self.logprobs:
            self.logprobs.rebase(upto, self.texts, self.done, self.decoded)

    def _past_emitted(self, text: str) -> str:
        """``text`` past ``emitted``, which it extends; a space first where the client has text
        that ``emitted`` does not show (a rebase to nothing: a window kept as silence)."""
        rest = text[len(self.emitted) :]
        return " " + rest if self.said and not self.emitted and rest and not rest[0].isspace() else rest

    def finish(self) -> list[TranscriptDelta]:
        """The rest of the text, if any, then the item carrying the ``Transcript``."""
        results = [r for r in self.results if r is not None]
        assert len(results) == len(self.windows)  # (every window is done)
        transcript = assemble(self.req, self.windows, self.texts, results, self.tokenizer, self.first_special)
        out = []
        extends = _extends(transcript.text, self.emitted)
        text = self._past_emitted(transcript.text) if extends else ""
        # Tokens held back (a window's that did not spell its live text) come last, with "" if need
        # be; none if the transcript does not go on from the text sent (``_rebase`` keeps it so).
        consistent = extends or transcript.text == self.emitted
        lps = self.logprobs.rest(transcript) if self.logprobs and consistent else None
        if text or lps:
            out.append(TranscriptDelta(text, logprobs=lps))
        return [*out, TranscriptDelta("", transcript)]
