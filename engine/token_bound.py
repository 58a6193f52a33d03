"""A text's token count bounded without tokenizing all of it, so an oversized input is refused,
or truncated, at the cost of what fits the context (a 28 MiB prompt took 32-48 s of CPU and
~5 GB here to learn it was 800x over the context; docs/BENCHMARKS.md).

``min_tokens``: a lower bound from a text's length. Sound only where tokenizing merges away no
characters: a BPE model over bytes (byte-level, or byte fallback), a pre-tokenizer that keeps
every character, a normalizer that never shortens the text, and no added token that swallows the
whitespace around it. Then every token stands for at most ``L`` bytes, ``L`` being its
vocabulary's longest token in UTF-8 (an upper bound on the bytes a token stands for in either
alphabet), so a text of ``n`` characters that all keep a byte has at least ``ceil(n / L)``
tokens. A byte missing from the vocabulary is dropped (SmolLM2's lacks 21, among them 6 ASCII
control characters): those characters are not counted, and a tokenizer missing a UTF-8
continuation byte (a multi-byte character could vanish) gets no bound. For any other tokenizer
the bound is 0 (no early refusal).

``head``: the text cut before a whitespace character near a given length, where tokenizing
splits words at whitespace (BERT's WordPiece and its kin): no token spans the cut, so the head's
tokens are the text's first tokens, and the text has at least as many.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from engine.errors import PromptTooLongError

_WHITESPACE_SPLITTERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
_PER_CHARACTER_NORMALIZERS = {"BertNormalizer", "Lowercase", "StripAccents", "NFC", "NFD", "NFKC", "NFKD", "Sequence"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "Sequence"}
_bytes_per_token: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()
_cuts_at_whitespace: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _keeps_text(node: Any, allowed: set[str]) -> bool:
    """Every component of a normalizer or pre-tokenizer tree is of an ``allowed`` type, and
    none removes characters."""
    if node is None:
        return True
    kind = node.get("type")
    if kind not in allowed or node.get("behavior") == "Removed":
        return False
    if kind == "Replace":  # a literal pattern, replaced by no fewer characters
        pattern = (node.get("pattern") or {}).get("String")
        if pattern is None or len(node.get("content", "")) < len(pattern):
            return False
    parts = node.get("normalizers") or node.get("pretokenizers") or []
    return all(_keeps_text(p, allowed) for p in parts)


def _spec(tokenizer: Any) -> dict[str, Any] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        return None if backend is None else json.loads(backend.to_str())  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - custom components do not serialize: no bound, no cut
        return None


def _per_tokenizer(cache: weakref.WeakKeyDictionary[Any, Any], tokenizer: Any, compute: Any) -> Any:
    try:
        return cache[tokenizer]
    except KeyError:
        value = cache[tokenizer] = compute(tokenizer)
        return value
    except TypeError:  # not weak-referenceable: compute every time
        return compute(tokenizer)


def _coverage(tokenizer: Any) -> tuple[int, str]:
    """(``L``, the characters tokenizing drops) as above; ``L`` = 0 where no bound is sound."""
    spec = _spec(tokenizer)
    if spec is None:
        return 0, ""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    vocab = tokenizer.get_vocab()
    if "ByteLevel" in json.dumps(pre):
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # (loaded with any tokenizer)

        missing = [b for b, symbol in bytes_to_unicode().items() if symbol not in vocab]
    elif model.get("byte_fallback"):
        missing = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
    else:
        return 0, ""  # an unknown character could become one <unk> for a whole run
    if model.get("type") != "BPE" or any(0x80 <= b < 0xC0 for b in missing):
        return 0, ""
    if not _keeps_text(pre, _KEEPING_PRE_TOKENIZERS):
        return 0, ""
    if not _keeps_text(spec.get("normalizer"), {"Prepend", "Replace", "Sequence"}):
        return 0, ""
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return 0, ""  # such a token absorbs any run of whitespace beside it
    return max((len(t.encode("utf-8")) for t in vocab), default=0), "".join(chr(b) for b in missing if b < 0x80)


def prepare(tokenizer: Any) -> None:
    """Work out the bound's terms now (~0.3 s for a 49k vocabulary), not on a request's path."""
    _per_tokenizer(_bytes_per_token, tokenizer, _coverage)
    _per_tokenizer(_cuts_at_whitespace, tokenizer, _splits_at_whitespace)


def min_tokens(tokenizer: Any, text: str) -> int:
    """At least this many tokens for ``text`` (0: no bound known)."""
    per_token, dropped = _per_tokenizer(_bytes_per_token, tokenizer, _coverage)
    if per_token <= 0:
        return 0
    kept = len(text) - sum(text.count(c) for c in dropped)
    return -(-kept // per_token)


def check_length(tokenizer: Any, text: str, max_model_len: int, max_tokens: int = 1) -> None:
    """``PromptTooLongError`` for a prompt ``text`` that, with ``max_tokens`` to generate, cannot
    fit ``max_model_len`` tokens whatever it says: before tokenizing it."""
    if len(text) + max_tokens <= max_model_len:  # (no token is shorter than a character)
        return
    at_least = min_tokens(tokenizer, text)
    if at_least + max_tokens > max_model_len:
        raise PromptTooLongError(at_least, max_tokens, max_model_len, num_chars=len(text))


def _splits_at_whitespace(tokenizer: Any) -> bool:
    """Words never span whitespace: a whitespace pre-tokenizer, a normalizer that works a
    character at a time, and no added token holding whitespace."""
    spec = _spec(tokenizer)
    if spec is None or (spec.get("pre_tokenizer") or {}).get("type") not in _WHITESPACE_SPLITTERS:
        return False
    if not _keeps_text(spec.get("normalizer"), _PER_CHARACTER_NORMALIZERS):
        return False
    return not any(any(c.isspace() for c in t.get("content", "")) for t in spec.get("added_tokens") or [])


def head(tokenizer: Any, text: str, num_chars: int) -> str | None:
    """``text`` cut before its last space within ``num_chars``, where that cut keeps every token
    whole (``_splits_at_whitespace``); None where ``text`` is no longer than that, has no space
    there, or the tokenizer may join text across whitespace. (A plain space only: a character
    Python calls whitespace may be a control character the normalizer deletes, joining words.)"""
    if len(text) <= num_chars or not _per_tokenizer(_cuts_at_whitespace, tokenizer, _splits_at_whitespace):
        return None
    cut = text.rfind(" ", 0, num_chars + 1)
    return text[:cut] if cut > 0 else None
