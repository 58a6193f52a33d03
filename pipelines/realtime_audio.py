"""The Realtime session's audio wire formats: pcm16 at 24 kHz, and G.711 μ-law / A-law at 8 kHz
(telephony: what a phone gateway such as Twilio's media streams sends and plays), each named as
the beta protocol names it (``input_audio_format``) and as GA does (``audio.input.format``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from modalities import g711
from modalities.audio import from_pcm16, to_pcm16

RATE = 24_000  # pcm16 in and out, as OpenAI sends it


@dataclass(frozen=True)
class WireFormat:
    """One format: its beta name, its GA object, its rate and bytes per sample."""

    name: str
    ga: dict[str, Any]
    rate: int
    width: int  # bytes per sample
    law: str | None = None  # G.711's; None: pcm16

    def decode(self, data: bytes) -> np.ndarray:
        """Float32 mono samples at ``rate``."""
        return from_pcm16(data) if self.law is None else g711.decode(data, self.law)

    def encode(self, samples: np.ndarray) -> bytes:
        """The bytes of float samples at ``rate``."""
        return to_pcm16(samples) if self.law is None else g711.encode(samples, self.law)


FORMATS = {
    f.name: f
    for f in (
        WireFormat("pcm16", {"type": "audio/pcm", "rate": RATE}, RATE, 2),
        WireFormat("g711_ulaw", {"type": "audio/pcmu"}, 8000, 1, "ulaw"),
        WireFormat("g711_alaw", {"type": "audio/pcma"}, 8000, 1, "alaw"),
    )
}
