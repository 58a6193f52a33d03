"""Serve a diffusion engine's requests with context parallelism (``mmserve serve --cp-degree N``).

:func:`enable_context_parallel` gives a ``DiffusionEngine`` a :class:`ContextParallelModel`: the
engine keeps batching, validating and previewing with its local ``DiffusionModel``, and every batch
runs across the runner's ranks instead of in-process.

Memory: each rank loads the whole pipeline (it runs every layer on its share of the tokens). The
serving process needs only configs (size rules, CP shapes) and the VAE (previews), so once the
ranks are up :func:`release_generation_weights` moves its denoiser and text encoders to the meta
device: ``N`` copies of those weights instead of ``N + 1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from modalities.diffusion.parallel.plans import plan_for
from modalities.diffusion.parallel.runner import ContextParallelRunner, forward_shape_for
from modalities.diffusion.parallel.volume import check_divisible

logger = logging.getLogger("mmserve.diffusion")


class ContextParallelModel:
    """A ``DiffusionModel`` whose :meth:`generate` runs on ``runner``; everything else (size rules,
    previews, counters) is the local model's. :meth:`check_shape` also rejects sizes the CP degree
    cannot shard, so they are a 400 before any compute."""

    def __init__(self, model: Any, runner: ContextParallelRunner) -> None:
        self._model = model
        self.runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def check_shape(self, width: int, height: int, num_frames: int | None = None) -> int:
        frames = self._model.check_shape(width, height, num_frames)
        shape = SimpleNamespace(width=width, height=height, num_frames=frames)
        check_divisible(self.runner.config, forward_shape_for(self._model, shape, batch=1))
        return frames

    def generate(
        self, shape: Any, items: Sequence[Any], on_step: Callable[[int, torch.Tensor], None] | None = None
    ) -> np.ndarray:
        out = self.runner.generate(shape, items, on_step)
        stats, counter = self.runner.last_stats, self._model.counter  # the engine's stats() reads this one
        counter.calls += stats["blocks_called"]
        counter.run += stats["blocks_run"]
        return out


def enable_context_parallel(engine: Any, degree: int, mode: str = "ulysses") -> ContextParallelRunner:
    """Start ``degree`` ranks for ``engine``'s pipeline and route its batches through them.

    Raises ``ValueError`` for a denoiser without a CP plan (UNets, unsupported DiTs)."""
    model = engine.model
    plan_for(model.denoiser)  # raises for unsupported models
    runner = ContextParallelRunner(model.path, degree, mode)
    runner.start()
    freed = release_generation_weights(model)
    engine.model = ContextParallelModel(model, runner)
    logger.info("%s: %.1f MiB of weights left to the ranks", engine.model_name, freed / 2**20)
    logger.info("%s runs on %d context-parallel ranks (%s, %s)", engine.model_name, degree, mode, runner.backend)
    return runner


def release_generation_weights(model: Any) -> int:
    """Free ``model``'s denoiser and text-encoder tensors (moved to the meta device: shapes and
    configs stay, storage goes); the VAE stays for previews. Returns the bytes released. Only for
    a model whose generation runs elsewhere (the CP ranks): it cannot generate afterwards."""
    freed = 0
    for name, module in model.pipe.components.items():
        if name == "vae" or not isinstance(module, torch.nn.Module):
            continue
        tensors = [*module.parameters(), *module.buffers()]
        freed += sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")
        module.to("meta")
    return freed
