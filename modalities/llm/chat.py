"""Chat messages to prompt token ids with the model's chat template (transformers 5 returns a
list, a nested list or a ``BatchEncoding`` depending on the call; this is the one place that
flattens it)."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """``tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)`` as a flat id list
    (``add_generation_prompt`` defaults to True). Template errors propagate."""
    kwargs.setdefault("add_generation_prompt", True)
    ids: Any = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def tokenize_chat_text(tokenizer: Any, text: str) -> list[int]:
    """The ids of a ``render_chat_text`` result: what ``render_chat`` returns for the same
    messages (``apply_chat_template`` tokenizes its text so), without rendering them again."""
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def render_chat_text(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The text ``render_chat`` tokenizes (``add_generation_prompt`` defaults to True)."""
    kwargs.setdefault("add_generation_prompt", True)
    return str(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))


def override_template(tokenizer: Any, path: str | None) -> None:
    """``--chat-template``: the Jinja template in ``path`` replaces the model's own (None: keep it)."""
    if path is not None:
        from pathlib import Path

        tokenizer.chat_template = Path(path).read_text(encoding="utf-8")
