"""Diffusion modality plugin: ``--image PATH`` / ``--video PATH`` (diffusers pipeline directories).

Off unless a pipeline is given. ``tiny-sd-unet``, ``tiny-dit`` and ``tiny-video`` name the tiny
random pipelines (made once under ``$MMSERVE_CACHE/tiny``). Importing this module registers the
``images.generate`` and ``videos.generate`` job kinds; torch and diffusers load only in ``build``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from gateway.argtypes import at_least
from gateway.plugins import Built, only_flag
from modalities.diffusion import jobs
from modalities.diffusion.api import router

__all__ = ["TINY_ARCHS", "add_serve_args", "build", "remote_engines", "router"]

logger = logging.getLogger("mmserve.diffusion")

jobs.register()


def _make_tiny(arch: str) -> Any:
    def make(out_dir: str | Path, seed: int = 0) -> Path:
        from modalities.diffusion.tiny import make_tiny

        return make_tiny(arch, out_dir, seed)

    return make


TINY_ARCHS = {arch: _make_tiny(arch) for arch in ("sd-unet", "dit", "video")}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("diffusion")
    g.add_argument("--image", default=None, help="text-to-image pipeline directory (or tiny-sd-unet, tiny-dit)")
    g.add_argument("--video", default=None, help="text-to-video pipeline directory (or tiny-video)")
    g.add_argument(
        "--diffusion-cache",
        default=None,
        help="default step cache when a request names none: off, light, medium, aggressive, or a first-block threshold",
    )
    g.add_argument(
        "--diffusion-max-batch", type=at_least(int, 1), default=8, help="most outputs generated in one batch"
    )
    g.add_argument(
        "--diffusion-batch-window-ms", type=at_least(float, 0), default=50.0, help="how long requests are collected"
    )
    g.add_argument("--diffusion-max-side", type=at_least(int, 16), default=1024, help="largest width/height accepted")
    g.add_argument(
        "--cp-degree",
        type=at_least(int, 1),
        default=1,
        help="context parallelism: run each DiT batch across N rank processes",
    )
    g.add_argument("--cp-mode", default="ulysses", choices=("ulysses", "ring", "hybrid"), help="context-parallel kind")


def resolve_pipeline_path(spec: str) -> Path:
    """A pipeline directory for ``spec``: a path, or ``tiny-<arch>`` (made on first use)."""
    if spec.startswith("tiny-") and spec[5:] in TINY_ARCHS:
        from modalities.diffusion.tiny import tiny_model_dir

        return tiny_model_dir(spec[5:])
    path = Path(spec).expanduser()
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"{spec} is not a diffusers pipeline directory (no model_index.json)")
    return path


def _engines(args: Any, weights: bool) -> list[tuple[str, Any]]:
    """``(spec, DiffusionEngine)`` per given pipeline (``--image``, ``--video``)."""
    from modalities.diffusion.engine import DiffusionEngine

    out = []
    for flag in ("image", "video"):
        spec = getattr(args, flag, None)
        if not spec:
            continue
        engine = DiffusionEngine.from_path(
            str(resolve_pipeline_path(spec)),
            max_side=getattr(args, "diffusion_max_side", 1024),
            weights=weights,
            default_cache=getattr(args, "diffusion_cache", None),
            max_batch_size=getattr(args, "diffusion_max_batch", 8),
            batch_window_s=getattr(args, "diffusion_batch_window_ms", 50.0) / 1000,
        )
        if engine.modality != flag:
            raise ValueError(f"--{flag} {spec} is a {engine.modality} pipeline")
        out.append((spec, engine))
    return out


def build(args: Any, explicit: bool = False) -> Built:
    """One engine per given pipeline (``--image``, ``--video``); none when neither is given."""
    built = Built()
    for spec, engine in _engines(args, weights=True):
        if (getattr(args, "cp_degree", 1) or 1) > 1:
            from modalities.diffusion.parallel.serving import enable_context_parallel

            enable_context_parallel(engine, args.cp_degree, getattr(args, "cp_mode", "ulysses"))
        built.engines[engine.model_name] = engine
        if spec != engine.model_name:
            built.aliases[spec] = engine.model_name
        logger.info("serving %s generation %s as %r", engine.modality, engine.model.path, engine.model_name)
    if explicit and not built.engines:
        raise ValueError(f"{only_flag(args)} diffusion: give --image or --video (a pipeline directory, or tiny-dit)")
    return built


def remote_engines(args: Any, cluster: Any) -> Built:
    """Under ``--dispatch celery``: a ``RemoteDiffusionEngine`` per given pipeline, named as ``build``
    names it; requests are validated here from the pipeline's configs (no weights) and run on
    ``mmserve worker --modality diffusion`` processes."""
    from modalities.diffusion.remote import RemoteDiffusionEngine

    built = Built()
    for spec, rules in _engines(args, weights=False):
        built.engines[rules.model_name] = RemoteDiffusionEngine(cluster, rules)
        if spec != rules.model_name:
            built.aliases[spec] = rules.model_name
    return built
