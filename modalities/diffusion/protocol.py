"""Request bodies of ``POST /v1/images/generations`` (OpenAI-compatible) and ``POST /v1/videos``.

Unknown OpenAI fields (``quality``, ``style``, ``user``, ...) are accepted and ignored, so the
official client's calls work unchanged; mmserve's extras (``steps``, ``guidance_scale``, ``seed``,
``negative_prompt``, ``cache``, ``cache_interval``) go in the body (``extra_body`` in the client).
Range checks that depend on the model (sizes, frames, steps, n) happen in the engine's
``prepare``, before any compute.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"WxH"`` -> ``(W, H)``; ``None`` or ``"auto"`` -> the model's default size."""
    if size is None or size == "auto":
        return None, None
    m = _SIZE.match(size)
    if m is None:
        raise ValueError(f"size must look like '512x512' (width x height), got {size!r}")
    return int(m.group(1)), int(m.group(2))


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str
    model: str | None = None
    size: str | None = None
    negative_prompt: str | None = None
    steps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    cache: str | float | None = None
    cache_interval: int | None = None

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        parse_size(v)
        return v

    @property
    def num_steps(self) -> int | None:
        return self.steps if self.steps is not None else self.num_inference_steps


class ImageGenerationRequest(_Common):
    """OpenAI ``images.generate`` plus mmserve extras. ``response_format`` defaults to ``b64_json``."""

    n: int = 1
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png"] | None = None


class VideoGenerationRequest(_Common):
    """``response_format``: ``mp4`` (the MP4 bytes, ``video/mp4``), ``b64_json`` (JSON with the MP4
    base64), ``frames`` (JSON with one base64 PNG per frame) or ``url`` (JSON with a result URL)."""

    num_frames: int | None = None
    fps: int = Field(default=16, ge=1, le=120)
    response_format: Literal["mp4", "b64_json", "frames", "url"] = "mp4"
    n: int = 1  # (named so that n > 1 is refused, not ignored)

    @field_validator("n")
    @classmethod
    def _one_video(cls, v: int) -> int:
        if v != 1:
            raise ValueError("a request makes one video: n must be 1")
        return v
