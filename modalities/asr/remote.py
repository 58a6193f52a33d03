"""The ASR engine's proxy under ``--dispatch celery``."""

from __future__ import annotations

from workers.remote import Cluster, RemoteEngine


class RemoteAsrEngine(RemoteEngine):
    """``run``/``stream`` on an ASR worker, with the upload limits the routes read off an ASR
    engine: this gateway's, since it reads and decodes the upload."""

    def __init__(self, cluster: Cluster, name: str, max_file_mb: float, max_audio_s: float) -> None:
        super().__init__(cluster, name, "asr")
        self.max_file_mb, self.max_audio_s = max_file_mb, max_audio_s
