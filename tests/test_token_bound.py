"""``engine.token_bound``: a token-count lower bound from a text's length, sound or absent."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from engine.token_bound import head, min_tokens


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from transformers import AutoTokenizer

    from engine.tiny_models import tiny_model_dir

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))  # SmolLM2's byte-level BPE


def _variant(tokenizer: Any, change: Callable[[dict[str, Any]], None]) -> Any:
    """The same tokenizer with its JSON spec edited by ``change``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    change(spec)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def _before_byte_level(spec: dict[str, Any], pre: dict[str, Any]) -> None:
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [pre, spec["pre_tokenizer"]]}


def test_the_bound_never_exceeds_the_real_count(smollm2: Any) -> None:
    longest = max(smollm2.get_vocab(), key=lambda t: len(smollm2.convert_tokens_to_string([t])))
    rng = random.Random(0)
    texts = [
        " " * 20_000,
        "\n" * 5_000 + "\t" * 5_000,
        smollm2.convert_tokens_to_string([longest]) * 300,
        "the " * 5_000,
        "".join(chr(rng.randrange(32, 0x3000)) for _ in range(5_000)),
        "<|im_start|>" * 1_000,  # a special token's own text
        "0123456789" * 1_000,
        "".join(chr(c) for c in range(32)) * 500,  # control characters: some bytes are not in the vocabulary
        "Summarize: " + "\x04" * 40_000,  # a byte SmolLM2 drops: 5 tokens in all
    ]
    for text in texts:
        bound = min_tokens(smollm2, text)
        assert bound <= len(smollm2.encode(text, add_special_tokens=False)), text[:40]
        assert bound > 0 or text.startswith("Summarize")
    assert min_tokens(smollm2, "") == 0


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(normalizer={"type": "NFKC"}),  # composes characters: a text can shrink
        lambda s: _before_byte_level(s, {"type": "Whitespace"}),  # drops the spaces
        lambda s: _before_byte_level(
            s, {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}
        ),
        lambda s: s["added_tokens"][0].update(lstrip=True),  # swallows the whitespace before it
        lambda s: s.update(
            normalizer={"type": "Replace", "pattern": {"String": "  "}, "content": " "}
        ),  # two characters become one
    ],
    ids=["nfkc", "whitespace", "split-removed", "lstrip-token", "shrinking-replace"],
)
def test_no_bound_where_tokenizing_may_drop_characters(smollm2: Any, change: Callable[[dict[str, Any]], None]) -> None:
    text = "a" * 10_000
    assert min_tokens(smollm2, text) > 0
    assert min_tokens(_variant(smollm2, change), text) == 0
    harmless = _variant(smollm2, lambda s: _before_byte_level(s, {"type": "Digits", "individual_digits": True}))
    assert min_tokens(harmless, text) > 0  # the rules above, not the edit itself


def test_no_bound_for_a_wordpiece_tokenizer() -> None:
    """An unknown word is one [UNK], however long: no bound (all-MiniLM-L6-v2's tokenizer)."""
    from transformers import AutoTokenizer

    from modalities.embed.model import default_embed_path

    tok = AutoTokenizer.from_pretrained(default_embed_path())
    assert min_tokens(tok, "a" * 10_000) == 0


def test_no_bound_where_a_continuation_byte_is_missing(smollm2: Any) -> None:
    """Byte 0xA9 ("©" in the byte-level alphabet) missing: a 2+ byte character may vanish."""

    class Missing:
        backend_tokenizer = smollm2.backend_tokenizer

        def get_vocab(self) -> dict[str, int]:
            return {t: i for t, i in smollm2.get_vocab().items() if t != "©"}

    assert min_tokens(Missing(), "a" * 10_000) == 0


def test_no_bound_and_no_cut_where_the_tokenizer_cannot_be_read() -> None:
    """Custom components make ``to_str`` raise: no bound, no head, no error."""

    class Backend:
        def to_str(self) -> str:
            raise Exception("Custom PreTokenizer cannot be serialized")

    class Custom:
        backend_tokenizer = Backend()

    assert min_tokens(Custom(), "a" * 10_000) == 0
    assert head(Custom(), "word " * 1_000, 100) is None


@pytest.fixture(scope="module")
def minilm() -> Any:
    from transformers import AutoTokenizer

    from modalities.embed.model import default_embed_path

    return AutoTokenizer.from_pretrained(default_embed_path())  # WordPiece, split at whitespace


def test_a_head_keeps_the_first_tokens_of_the_text(minilm: Any) -> None:
    rng = random.Random(1)
    pieces = ["word", "Ünïcödé", "naïve", "東京都", "a\x1cb", "x\u200by", "end.", "(quoted)", "\t", "\n", "don't", "é"]
    for trial in range(30):
        text = " ".join(rng.choice(pieces) for _ in range(rng.randrange(50, 400)))
        cut = head(minilm, text, rng.randrange(20, len(text) - 1))
        if cut is None:
            continue
        first = minilm(cut, add_special_tokens=False)["input_ids"]
        whole = minilm(text, add_special_tokens=False)["input_ids"]
        assert whole[: len(first)] == first, (trial, cut[-30:])
    assert head(minilm, "short text", 100) is None
    assert head(minilm, "x" * 1000, 100) is None  # no space to cut at


def test_no_head_where_words_may_span_whitespace(smollm2: Any) -> None:
    assert head(smollm2, "hello world " * 100, 50) is None  # byte-level BPE keeps spaces in tokens
