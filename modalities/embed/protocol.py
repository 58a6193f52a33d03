"""OpenAI-compatible request model for ``POST /v1/embeddings``.

``input`` is a string, a list of strings, a list of token ids, or a list of token-id lists (the
OpenAI forms). Extras: ``truncate`` (bool: cut inputs to the model's maximum length instead of
rejecting them) and vLLM's ``truncate_prompt_tokens`` (int: cut to that many tokens, -1 = the
model's maximum). Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` body."""

    # Strict: JSON's true is no dimension count and "3" no integer (pydantic would take both).
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    dimensions: int | None = Field(default=None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    truncate: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    @field_validator("input")
    @classmethod
    def _check_input(
        cls, v: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(v, str):
            if not v:
                raise ValueError("input must be a non-empty string")
            return v
        if not v:
            raise ValueError("input must not be an empty list")
        if len(v) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs are allowed per request, got {len(v)}")
        if isinstance(v[0], str) and any(not s for s in v):  # type: ignore[union-attr]
            raise ValueError("input strings must be non-empty")
        if isinstance(v[0], list) and any(not ids for ids in v):  # type: ignore[union-attr]
            raise ValueError("token id lists must be non-empty")
        return v

    def inputs(self) -> list[str] | list[list[int]]:
        """The input as a list of strings or a list of token-id lists."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if v and isinstance(v[0], int):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]

    def truncation(self) -> int | None:
        """Token cap requested by the client (``-1``: the model's maximum), or ``None`` for none."""
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != 0:
            return self.truncate_prompt_tokens
        return -1 if self.truncate else None
