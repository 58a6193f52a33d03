"""Long audio → ≤30 s windows → one transcript.

``plan_windows`` packs VAD speech spans greedily into windows of at most ``max_s`` seconds
(WhisperX-style: a window is the original audio from its first span's start to its last span's
end, so timestamps map back by an offset). A single span longer than a window is cut into
windows that overlap by ``overlap_s``, each cut placed at the quietest 20 ms inside the last
``search_s`` seconds, so a cut rarely lands inside a word and any word it does split is heard
whole by the next window. ``stitched_spans`` drops the words the overlap made both windows transcribe,
by aligning the end of one text with the start of the next.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from modalities.asr.quality import WindowResult
from modalities.asr.types import Segment, Word

RATE = 16_000


@dataclass(frozen=True)
class Window:
    start: float  # seconds in the original audio
    end: float
    overlaps_prev: bool = False  # starts inside the previous window (a long span was split)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _quietest(audio: np.ndarray, lo: float, hi: float) -> float:
    """Centre (s) of the lowest-energy 20 ms frame in [lo, hi)."""
    frame = RATE // 50
    a, b = int(lo * RATE), int(hi * RATE)
    seg = audio[a:b]
    n = len(seg) // frame
    if n < 1:
        return hi
    energy = (seg[: n * frame].reshape(n, frame) ** 2).mean(axis=1)
    return (a + int(energy.argmin()) * frame + frame // 2) / RATE


def _split_long(
    audio: np.ndarray, start: float, end: float, max_s: float, overlap_s: float, search_s: float
) -> list[Window]:
    out: list[Window] = []
    cur = start
    while end - cur > max_s:
        cut = _quietest(audio, cur + max_s - search_s, cur + max_s)
        out.append(Window(cur, cut, overlaps_prev=bool(out)))
        cur = cut - overlap_s
    out.append(Window(cur, end, overlaps_prev=bool(out)))
    return out


def plan_windows(
    audio: np.ndarray,
    spans: list[tuple[float, float]],
    max_s: float = 30.0,
    overlap_s: float = 2.0,
    search_s: float = 5.0,
) -> list[Window]:
    """Windows covering every speech span, each ≤ ``max_s`` long, in time order."""
    windows: list[Window] = []
    cur: tuple[float, float] | None = None
    for start, end in spans:
        if end - start > max_s:
            if cur is not None:
                windows.append(Window(*cur))
                cur = None
            windows.extend(_split_long(audio, start, end, max_s, overlap_s, search_s))
        elif cur is not None and end - cur[0] <= max_s:
            cur = (cur[0], end)
        else:
            if cur is not None:
                windows.append(Window(*cur))
            cur = (start, end)
    if cur is not None:
        windows.append(Window(*cur))
    return windows


_WORD = re.compile(r"[^\w']+")
_NON_SPACE = re.compile(r"\S+")  # a word as ``str.split`` cuts it
_TAIL_WORDS = 12  # how far from the end of the earlier window's text the shared words are looked for
_MIN_MATCH = 2  # shared words needed to trust the match
# Faster than anyone speaks for long: the words both windows heard (and any either heard in part)
# lie in their overlap, so a match spanning more words than this many a second is a phrase said twice.
_MAX_WORDS_PER_S = 4.5


def _norm(word: str) -> str:
    return _WORD.sub("", word.lower())


def _overlap_cut(a: list[str], b: list[str], tail_words: int, min_match: int, max_span: int) -> tuple[int, int] | None:
    """Where two overlapping windows' words meet: ``(words of a kept, words of b dropped)``, or
    None when they share no run of ``min_match`` words near a's end and b's start that fits in
    their overlap: the run, what ``a`` says after it and what ``b`` says before it, at most
    ``max_span`` words (a longer one is a phrase said twice, e.g. "and then", and cutting there
    would lose the words between). The words both transcribed are kept from ``b``, which heard
    them whole; anything ``a`` said after them (a word cut at the window's end) is dropped."""
    if not a or not b:
        return None
    ta = len(a) - min(tail_words, len(a))
    na = [_norm(w) for w in a[ta:]]
    nb = [_norm(w) for w in b[: min(tail_words, len(b))]]
    fits = [
        m
        for m in difflib.SequenceMatcher(None, na, nb, autojunk=False).get_matching_blocks()
        if m.size >= min_match and any(na[m.a : m.a + m.size]) and len(na) - m.a + m.b <= max_span
    ]
    if not fits:
        return None
    match = max(fits, key=lambda m: m.size)
    return ta + match.a, match.b


def stitched_spans(windows: list[Window], texts: list[str]) -> list[tuple[int, int]]:
    """Per window, the ``[first, last)`` range of its words (``text.split()``) that the transcript
    keeps once the overlap between consecutive split windows is removed (``_overlap_cut``)."""
    words = [t.split() for t in texts]
    spans = [(0, len(w)) for w in words]
    for i in range(1, len(windows)):
        if windows[i].overlaps_prev:
            lo, hi = spans[i - 1]
            overlap_s = max(0.0, windows[i - 1].end - windows[i].start)
            max_span = math.ceil(overlap_s * _MAX_WORDS_PER_S) + 1  # (+1: a word either window cut)
            cut = _overlap_cut(words[i - 1][lo:hi], words[i], _TAIL_WORDS, _MIN_MATCH, max_span)
            if cut is not None:
                spans[i - 1], spans[i] = (lo, lo + cut[0]), (cut[1], len(words[i]))
    return spans


def stitched_texts(windows: list[Window], texts: list[str]) -> list[str]:
    """Per-window texts with the overlap between consecutive split windows removed."""
    return [_span_text(t, lo, hi) for t, (lo, hi) in zip(texts, stitched_spans(windows, texts), strict=True)]


def _span_text(text: str, lo: int, hi: int) -> str:
    """Words ``[lo, hi)`` of ``text`` as written, with the whitespace between them: a part of a
    text is then a prefix of a longer part (a stream's stable text grows by appending even where
    the decoder wrote two spaces)."""
    if hi <= lo:
        return ""
    words = list(_NON_SPACE.finditer(text))
    return text[words[lo].start() : words[hi - 1].end()]


def stable_spans(windows: list[Window], texts: list[str], done: list[bool]) -> list[tuple[int, int, int]]:
    """``(window, first word, last word + 1)`` of each part of the transcript prefix that can no
    longer change: finished windows in order, then the live text of the first unfinished one but
    its last word (a window decoded on from its last word, ``AsrEngine._with_rest``, may end
    otherwise). Where a long span was split, the stitch only ever drops the last ``_TAIL_WORDS``
    words of the earlier window's text (``_overlap_cut``): the rest of it is stable once the
    windows before it are done, the later window's once it is done too."""
    n = 0
    while n < len(windows) and done[n]:
        n += 1
    # Windows k..n-1 are done and n overlaps them (one long span): the stitch with n is to come.
    k = n
    while k > 0 and k < len(windows) and windows[k].overlaps_prev:
        k -= 1
    spans = [(i, lo, hi) for i, (lo, hi) in enumerate(stitched_spans(windows[:n], texts[:n]))]
    if k < n:  # the last done one's tail waits for n; the unfinished n says nothing yet
        i, lo, hi = spans[-1]
        spans[-1] = (i, lo, max(lo, hi - _TAIL_WORDS))
    elif n < len(windows):
        tail_waits = n + 1 < len(windows) and windows[n + 1].overlaps_prev
        spans.append((n, 0, max(0, len(texts[n].split()) - (_TAIL_WORDS if tail_waits else 1))))
    return spans


def stable_text(texts: list[str], spans: list[tuple[int, int, int]]) -> str:
    """The transcript prefix that can no longer change, from its ``stable_spans``."""
    return " ".join(p for i, lo, hi in spans if (p := _span_text(texts[i], lo, hi)))


def window_segments(windows: list[Window], texts: list[str], results: list[WindowResult]) -> list[Segment]:
    """The transcript's segments: one per window that kept text after stitching, with its figures.
    Windows that overlap (a long span split) meet in the middle of their overlap, so segments do
    not overlap (a subtitle shows one cue at a time); where the stitch gave the overlap's words is
    not known in time without word timestamps."""
    starts = [w.start for w in windows]
    for i in range(1, len(windows)):
        if windows[i].overlaps_prev:
            starts[i] = (windows[i].start + windows[i - 1].end) / 2
    last = len(windows) - 1
    ends = [starts[i + 1] if i < last and windows[i + 1].overlaps_prev else w.end for i, w in enumerate(windows)]
    segments = []
    for start, end, text, r in zip(starts, ends, stitched_texts(windows, texts), results, strict=True):
        if text:
            segments.append(
                Segment(
                    len(segments),
                    round(start, 3),
                    round(end, 3),
                    text,
                    r.tokens,
                    r.avg_logprob,
                    r.temperature,
                    r.compression_ratio,
                    r.no_speech_prob,
                )
            )
    return segments


def meet_at_words(segments: list[Segment], words: list[Word]) -> None:
    """Where two segments meet inside an overlap (``window_segments``), move the meeting point to
    the later one's first word: with word times, where the stitch cut is known."""
    first = 0
    for prev, seg in zip(segments, segments[1:], strict=False):
        first += len(prev.text.split())
        if seg.start == prev.end and first < len(words):
            prev.end = seg.start = round(words[first].start, 3)


_SENTENCE_END = re.compile(r"[.?!…。？！।]['\"”’)\]」』]*$")
PAUSE_S = 1.0  # a silence this long between two words ends a cue too


def sentence_segments(segments: list[Segment], words: list[Word], tokens: Callable[[str], list[int]]) -> list[Segment]:
    """``segments`` (one per window) cut after each sentence's last word and at each pause of
    ``PAUSE_S`` between words, at the words' times (``words``: the transcript's, in order): cues
    a subtitle can show. Each piece keeps its window's figures; its ``tokens`` are ``tokens`` of
    its text. ``segments`` as they are when the words do not match their texts."""
    if len(words) != sum(len(s.text.split()) for s in segments):
        return segments
    out: list[Segment] = []
    at = 0
    for seg in segments:
        mine = words[at : at + len(seg.text.split())]
        at += len(mine)
        groups: list[list[Word]] = [[]]
        for k, w in enumerate(mine):
            groups[-1].append(w)
            nxt = mine[k + 1] if k + 1 < len(mine) else None
            if nxt is not None and (_SENTENCE_END.search(w.word) or nxt.start - w.end >= PAUSE_S):
                groups.append([])
        if len(groups) == 1:  # (also a segment with no words)
            out.append(dataclasses.replace(seg, id=len(out)))
            continue
        for k, group in enumerate(groups):
            text = " ".join(w.word for w in group)
            start = seg.start if k == 0 else group[0].start
            end = seg.end if k == len(groups) - 1 else group[-1].end
            out.append(dataclasses.replace(seg, id=len(out), start=start, end=end, text=text, tokens=tokens(text)))
    return out
