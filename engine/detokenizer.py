"""Incremental detokenisation and stop strings, per sequence."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens before the first new one that are re-decoded for context (leading spaces, merges).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas. Text is only released once it decodes
    cleanly: a token that ends mid-way through a multi-byte UTF-8 character (decoded as
    U+FFFD) is held back until the next token completes it."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text) :]


class StopStringMatcher:
    """Finds the earliest stop string in the text and holds back a tail that might still grow
    into one, so a streamed client never sees part of a stop string."""

    def __init__(self, stop: list[str], include_in_output: bool) -> None:
        self.stop = stop
        self.include = include_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def find(self, text: str, new_chars: int) -> tuple[int, str] | None:
        """Return (cut position, matched stop string) if one ends within the last ``new_chars``."""
        if not self.stop:
            return None
        search_from = max(0, len(text) - new_chars - self.holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        return (idx + len(s) if self.include else idx, s)

    def releasable(self, text: str, finished: bool) -> int:
        """How many characters of ``text`` may be shown now."""
        return len(text) if finished or not self.stop else max(0, len(text) - self.holdback)
