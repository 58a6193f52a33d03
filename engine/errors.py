"""Errors the engine raises at admission; the gateway maps them to OpenAI error JSON."""

from __future__ import annotations

from collections.abc import Iterable


class EngineError(Exception):
    """Base class for the errors the engine reports to a request's caller."""


class QueueFullError(EngineError):
    """The waiting queue is at ``max_waiting`` (or, ``state`` "in progress", the requests held at
    their bound: ``engine.admission``): the caller should retry later (HTTP 429)."""

    def __init__(self, num_waiting: int, retry_after_s: float = 1.0, state: str = "waiting") -> None:
        super().__init__(f"the server is busy: {num_waiting} requests are already {state}; retry later")
        self.num_waiting, self.retry_after_s = num_waiting, retry_after_s


class InvalidParamError(EngineError, ValueError):
    """A sampling parameter the engine can't use (HTTP 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Raise ``InvalidParamError`` naming ``param`` for the first id outside the vocabulary (as an
    index into logits or embeddings it would fail a whole batch, not just its request)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParamError(f"token id {bad} is out of range for a vocabulary of {vocab_size} tokens", param)


class PromptTooLongError(EngineError, ValueError):
    """Prompt plus requested output does not fit the model's context (HTTP 400)."""

    def __init__(
        self, num_prompt_tokens: int, max_tokens: int, max_model_len: int, num_chars: int | None = None
    ) -> None:
        """``num_chars``: the prompt was not tokenized; it has this many characters, so at least
        ``num_prompt_tokens`` tokens (``engine.token_bound``)."""
        if num_chars is not None:
            asked = f"your prompt has {num_chars} characters, at least {num_prompt_tokens} tokens"
        else:
            asked = f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt"
            asked += f", {max_tokens} for the completion)"
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, {asked}. "
            "Please reduce the prompt or max_tokens."
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class EngineDeadError(EngineError):
    """The engine loop crashed; every in-flight request is failed with this (HTTP 500/503)."""


class RequestFailedError(EngineError):
    """The engine failed while running a step that held this request (a bug or a resource
    failure, not the request's input): the request is dropped, the engine serves on (HTTP 500)."""
