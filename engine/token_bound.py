"""A lower bound on a text's token count from its length alone, so an oversized prompt is refused
before it is tokenized (30 MB of text took its request ~25 s of CPU and ~2 GB here to learn it
was ~100x over the context).

Sound only where tokenizing never drops or merges away characters: a BPE model that covers every
byte (byte-level, or byte fallback), a pre-tokenizer that keeps every character, a normalizer
that never shortens the text, and no added token that swallows the whitespace around it. Then
every token stands for at most ``L`` bytes, ``L`` being its vocabulary's longest token in UTF-8
(an upper bound on the bytes a token stands for in either alphabet), and a text of ``n``
characters has at least ``n`` bytes, so at least ``ceil(n / L)`` tokens. For any other tokenizer
the bound is 0 (no early refusal).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "Sequence"}
_bytes_per_token: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


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


def _max_token_bytes(tokenizer: Any) -> int:
    """``L`` above, or 0 where the bound would not be sound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return 0
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    byte_level = "ByteLevel" in json.dumps(pre)
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return 0  # an unknown character could become one <unk> for a whole run
    if not _keeps_text(pre, _KEEPING_PRE_TOKENIZERS):
        return 0
    if not _keeps_text(spec.get("normalizer"), {"Prepend", "Replace", "Sequence"}):
        return 0
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return 0  # such a token absorbs any run of whitespace beside it
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=0)


def min_tokens(tokenizer: Any, num_chars: int) -> int:
    """At least this many tokens for any text of ``num_chars`` characters (0: no bound known)."""
    try:
        per_token = _bytes_per_token[tokenizer]
    except KeyError:
        per_token = _bytes_per_token[tokenizer] = _max_token_bytes(tokenizer)
    except TypeError:  # not weak-referenceable: compute every time
        per_token = _max_token_bytes(tokenizer)
    return -(-num_chars // per_token) if per_token > 0 else 0
