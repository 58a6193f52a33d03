"""The gateway's TTS engines under ``--dispatch celery``: ``RemoteTTSEngine`` has what the routes,
the voice registry and ``check_request`` read (``modality``, ``model_name``, ``voices``,
``sample_rate``, ``supports_speed``), taken from the model files without loading the model, and
``stream`` runs on a ``mmserve worker --modality tts`` process (its count of what was used comes
back into ``req.usage``). Closing the stream (a client that disconnected) aborts the synthesis on
the worker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import numpy as np

from modalities.tts.protocol import TTSRequest, TTSUsage
from workers.remote import Cluster, RemoteEngine


class RemoteTTSEngine(RemoteEngine):
    """A TTS engine (``modalities.tts.base`` contract) whose synthesis runs on workers."""

    def __init__(self, cluster: Cluster, name: str, voices: list[str], sample_rate: int, supports_speed: bool) -> None:
        super().__init__(cluster, name, "tts")
        self.voices, self.sample_rate, self.supports_speed = list(voices), int(sample_rate), supports_speed

    async def stream(self, req: TTSRequest) -> AsyncIterator[np.ndarray]:  # type: ignore[override]
        """The worker's chunks (``ReportsUsage.stream_with_usage``); its ``usage`` goes to ``req``."""
        async with aclosing(self.stream_call("stream_with_usage", req)) as items:
            async for item in items:
                if isinstance(item, TTSUsage):  # (in place: as a local engine counts)
                    req.usage.input_tokens, req.usage.output_tokens = item.input_tokens, item.output_tokens
                else:
                    yield item

    @classmethod
    def piper(cls, cluster: Cluster, spec: str | None) -> RemoteTTSEngine:
        """The proxy of ``PiperEngine(spec)``: an unstarted engine only reads the voice's JSON."""
        from modalities.tts.piper_engine import PiperEngine

        local = PiperEngine(spec)
        return cls(cluster, local.model_name, local.voices, local.sample_rate, local.supports_speed)

    @classmethod
    def autoregressive(cls, cluster: Cluster, model_dir: str | Path) -> RemoteTTSEngine:
        """The proxy of ``ARTTSEngine.from_dir(model_dir)``: its token layout and codec config only."""
        from transformers import AutoConfig

        from engine.model_loader import served_name
        from modalities.tts.ar_engine import ARTTSEngine, ARTTSLayout

        path = Path(model_dir).expanduser()
        layout = ARTTSLayout.load(path)
        codec = AutoConfig.from_pretrained(path / layout.codec_dir, local_files_only=True)
        return cls(cluster, served_name(path), list(layout.voices), codec.sampling_rate, ARTTSEngine.supports_speed)
