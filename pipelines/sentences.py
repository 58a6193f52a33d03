"""Streaming text → sentences for the speech pipelines' TTS: a sentence is spoken as soon as it
is complete. The reply's first piece is cut sooner, for a sooner first audio: at a clause of
``FIRST_CLAUSE_WORDS`` words or more, or after ``FIRST_PIECE_MAX_WORDS`` complete words (waiting
for a long first sentence costs its decode and its synthesis, ~0.3 s more on 2 cores). Unlike
``modalities.tts.text.split_text``, which splits a whole text, this decides on a growing prefix,
one delta at a time.
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"[.!?;:](?:[\"')\]]*)\s+|\n+")
_CLAUSE_END = re.compile(r",\s+")
FIRST_CLAUSE_WORDS = 4  # the reply's first clause of at least this many words is spoken on its own
FIRST_PIECE_MAX_WORDS = 6  # a first sentence longer than this is cut after its 6th word
# A word is complete once whitespace follows it (the next delta could still extend it).
_FIRST_WORDS = re.compile(rf"\s*(?:\S+\s+){{{FIRST_PIECE_MAX_WORDS}}}")


class SentenceSplitter:
    """Streaming text → sentences: ``feed`` returns the sentences the text completes (the first
    may be a clause, for a sooner first audio), ``flush`` the rest."""

    def __init__(self) -> None:
        self.buf = ""
        self.index = 0  # sentences returned so far

    def feed(self, text: str) -> list[str]:
        self.buf += text
        out = []
        while (m := self._boundary()) is not None:
            piece, self.buf = self.buf[: m.end()].strip(), self.buf[m.end() :]
            if piece:
                out.append(piece)
                self.index += 1
        return out

    def flush(self) -> str:
        rest, self.buf, self.index = self.buf.strip(), "", 0
        return rest

    def _boundary(self) -> re.Match[str] | None:
        """End of the next sentence; for the first piece also a clause or a word cap, whichever
        comes first (sooner first audio)."""
        m = _SENTENCE_END.search(self.buf)
        if self.index > 0:
            return m
        c = _CLAUSE_END.search(self.buf)
        if c is not None and len(self.buf[: c.start()].split()) < FIRST_CLAUSE_WORDS:
            c = None
        found = [b for b in (m, c, _FIRST_WORDS.match(self.buf)) if b is not None]
        return min(found, key=lambda b: b.end()) if found else None
