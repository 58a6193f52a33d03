"""Text splitting for streaming TTS: synthesis starts on the first piece while the rest waits.

Pieces are sentences; a sentence longer than ``max_chars`` is cut at clause punctuation, then at
word boundaries. A first piece longer than ``first_chars`` is cut too, at its first clause
boundary within ``2 * first_chars``, else at the last word boundary within ``first_chars``: a
short first piece is what keeps time-to-first-audio low (engines shrink ``first_chars`` under load).
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?…。！？])[\"')\]]*\s+|\n\s*\n+")
_CLAUSE_END = re.compile(r"(?<=[,;:—])\s+")


def _cut(text: str, limit: int) -> list[str]:
    """Cut ``text`` into pieces of at most ``limit`` chars: at clause ends when possible, else at
    the last space before the limit, else hard."""
    out: list[str] = []
    while len(text) > limit:
        window = text[: limit + 1]
        cuts = [m.end() for m in _CLAUSE_END.finditer(window)]
        cut = cuts[-1] if cuts else window.rfind(" ") + 1
        if cut <= 0:
            cut = limit
        out.append(text[:cut].strip())
        text = text[cut:].strip()
    if text:
        out.append(text)
    return out


def split_text(text: str, max_chars: int = 300, first_chars: int = 60) -> list[str]:
    """Non-empty pieces whose concatenation (with spaces) is ``text``'s words in order."""
    pieces: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        sentence = " ".join(sentence.split())
        if sentence:
            pieces.extend(_cut(sentence, max_chars))
    if pieces and len(pieces[0]) > first_chars:
        head = pieces[0]
        m = _CLAUSE_END.search(head, 0, first_chars * 2)
        cut = m.end() if m is not None else head.rfind(" ", 0, first_chars + 1) + 1
        if 0 < cut < len(head):
            pieces[:1] = [head[:cut].strip(), head[cut:].strip()]
    return pieces
