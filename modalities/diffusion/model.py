"""One diffusers pipeline loaded from a local directory, plus what the server needs to know about it.

:class:`DiffusionModel` answers "which sizes, frame counts and steps may a request ask for" without
running anything (so bad input is a 400 before any compute), and runs one *batch* of generations
through the pipeline's own ``__call__`` with one ``torch.Generator`` per output, so each output's
initial noise depends only on its seed: a batch gives every item what it would get alone.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.errors import InvalidParamError  # noqa: E402
from modalities.diffusion.cache import BlockCounter, CacheSpec, CacheSwitch  # noqa: E402

logger = logging.getLogger("mmserve.diffusion")


class StopGeneration(Exception):
    """Raised from the step callback to end a batch whose requests were all cancelled."""


@dataclass(frozen=True)
class Item:
    """One output to generate: its prompt, negative prompt and seed (the batch shares the rest)."""

    prompt: str
    negative_prompt: str
    seed: int


@dataclass(frozen=True)
class Shape:
    """What a batch shares: output size, frames (videos), steps, guidance and cache setting."""

    width: int
    height: int
    num_frames: int
    steps: int
    guidance_scale: float
    cache: CacheSpec


class DiffusionModel:
    """A loaded ``DiffusionPipeline`` (image or video) and its size rules."""

    def __init__(self, path: str | Path, *, max_side: int = 1024, max_frames: int = 129, weights: bool = True) -> None:
        """``weights=False`` builds the pipeline's skeleton (configs only, parameters on the meta
        device): the size rules and defaults of the real thing, for validating requests where the
        model runs elsewhere (the gateway under celery dispatch); it cannot generate."""
        from diffusers import DiffusionPipeline

        self.path = Path(path)
        if not (self.path / "model_index.json").is_file():
            raise FileNotFoundError(f"{self.path} is not a diffusers pipeline directory (no model_index.json)")
        if weights:
            self.pipe = DiffusionPipeline.from_pretrained(str(self.path), dtype=torch.float32)
        else:
            self.pipe = skeleton_pipeline(self.path)
        self.pipe.set_progress_bar_config(disable=True)
        self.name = self.path.name
        self.params = set(inspect.signature(self.pipe.__call__).parameters)
        self.is_video = "num_frames" in self.params
        self.denoiser: torch.nn.Module = getattr(self.pipe, "transformer", None) or self.pipe.unet
        self.is_unet = self.denoiser is getattr(self.pipe, "unet", None)
        self.multiple, self.default_side = self._size_rules()
        self.max_side = max(max_side, self.default_side)
        self.frame_step = int(getattr(self.pipe, "vae_scale_factor_temporal", 1)) if self.is_video else 1
        self.max_frames = max_frames
        self.default_frames = 1 + 4 * self.frame_step if self.is_video else 1
        # PixArt-alpha treats 1 step as its DMD one-step mode, which needs a scheduler returning x0
        self.min_steps = 2 if type(self.pipe).__name__.startswith("PixArtAlpha") else 1
        self.cache = CacheSwitch(self.denoiser)
        self.counter = BlockCounter(self.denoiser)

    def _size_rules(self) -> tuple[int, int]:
        """(pixel multiple, default side): VAE factor times the denoiser's patch or downsampling."""
        pipe, cfg = self.pipe, self.denoiser.config
        vae = int(getattr(pipe, "vae_scale_factor_spatial", 0) or getattr(pipe, "vae_scale_factor", 8))
        if self.is_unet:
            per_latent = 2 ** (len(cfg.block_out_channels) - 1)
        else:
            patch = cfg.get("patch_size", 1) or 1
            per_latent = int(patch[-1] if isinstance(patch, (list, tuple)) else patch)
        sample = cfg.get("sample_size", None)
        side = (
            int(sample[-1] if isinstance(sample, (list, tuple)) else sample) * vae if sample else 8 * vae * per_latent
        )
        # lcm with 8: most pipelines' check_inputs insist on multiples of 8 whatever their VAE factor
        return math.lcm(vae * per_latent, 8), side

    # -- validation (no compute) ----------------------------------------------------------------

    def check_shape(self, width: int, height: int, num_frames: int | None = None) -> int:
        """Raise ``ValueError`` unless the model can make ``width x height`` (and ``num_frames``);
        return the frame count to use (1 for images)."""
        m = self.multiple
        for what, v in (("width", width), ("height", height)):
            if v < m or v % m or v > self.max_side:
                raise InvalidParamError(
                    f"{what} {v} is not supported: use a multiple of {m} between {m} and {self.max_side} for this model",
                    "size",
                )
        if not self.is_video:
            if num_frames not in (None, 1):
                raise InvalidParamError("this is an image model; num_frames does not apply", "num_frames")
            return 1
        frames = self.default_frames if num_frames is None else num_frames
        if frames < 1 or (frames - 1) % self.frame_step or frames > self.max_frames:
            raise InvalidParamError(
                f"num_frames {frames} is not supported: use {self.frame_step}k+1 frames, at most {self.max_frames}",
                "num_frames",
            )
        return frames

    # -- generation -----------------------------------------------------------------------------

    def generate(
        self, shape: Shape, items: Sequence[Item], on_step: Callable[[int, torch.Tensor], None] | None = None
    ) -> np.ndarray:
        """Run one batch; returns float32 in [0, 1], ``[B, H, W, 3]`` (images) or ``[B, F, H, W, 3]``
        (videos). ``on_step(i, latents)`` runs after each denoising step (``i`` from 1) and may raise
        :class:`StopGeneration`."""
        kwargs: dict[str, Any] = dict(
            prompt=[it.prompt for it in items],
            negative_prompt=[it.negative_prompt for it in items],
            width=shape.width,
            height=shape.height,
            num_inference_steps=shape.steps,
            guidance_scale=shape.guidance_scale,
            generator=[torch.Generator().manual_seed(it.seed) for it in items],
            output_type="np",
        )
        if self.is_video:
            kwargs["num_frames"] = shape.num_frames
        for flag in ("use_resolution_binning", "clean_caption"):  # PixArt-style: keep the asked size, no bs4/ftfy
            if flag in self.params:
                kwargs[flag] = False
        if on_step is not None and "callback_on_step_end" in self.params:

            def on_step_end(pipe: Any, i: int, t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                on_step(i + 1, tensors["latents"])
                return {}

            kwargs["callback_on_step_end"] = on_step_end
        elif on_step is not None:  # older pipelines (PixArt-alpha): callback(step, timestep, latents)
            kwargs.update(callback=lambda i, t, latents: on_step(i + 1, latents), callback_steps=1)
        self.cache.set(shape.cache, requests=len(items))
        with torch.inference_mode(), self.cache.context():
            out = self.pipe(**kwargs)
        frames = out.frames if self.is_video else out.images
        return np.asarray(frames, dtype=np.float32)

    def decode_preview(self, latents: torch.Tensor) -> np.ndarray:
        """Decode (intermediate) latents of one output with the pipeline's VAE: float32 in [0, 1]."""
        with torch.inference_mode():
            vae = self.pipe.vae
            x = latents.to(vae.dtype)
            if self.is_video:
                cfg = vae.config
                mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
                std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
                video = vae.decode(x * std + mean, return_dict=False)[0]
                return self.pipe.video_processor.postprocess_video(video, output_type="np")[0].astype(np.float32)
            image = vae.decode(x / vae.config.scaling_factor, return_dict=False)[0]
            return self.pipe.image_processor.postprocess(image, output_type="np")[0].astype(np.float32)


def skeleton_pipeline(path: Path) -> Any:
    """The pipeline of ``path`` built from its configs alone: diffusers models with empty (meta)
    parameters, schedulers from their configs, every other component (text encoders, tokenizers,
    safety checkers) left out. The pipeline's ``__init__`` derives its VAE factors from these."""
    import importlib
    import json

    import diffusers
    from accelerate import init_empty_weights
    from diffusers import ModelMixin, SchedulerMixin

    index = json.loads((path / "model_index.json").read_text())
    pipe_cls = getattr(diffusers, index["_class_name"])
    accepted = inspect.signature(pipe_cls.__init__).parameters
    components: dict[str, Any] = {}
    for name, spec in index.items():
        if name.startswith("_") or name not in accepted:
            continue
        if not isinstance(spec, list):  # a plain __init__ option (e.g. ``requires_safety_checker``)
            components[name] = spec
            continue
        library, cls_name = spec
        cls = getattr(importlib.import_module(library), cls_name, None) if library and cls_name else None
        if isinstance(cls, type) and issubclass(cls, ModelMixin):
            with init_empty_weights():
                components[name] = cls.from_config(cls.load_config(path / name))
        elif isinstance(cls, type) and issubclass(cls, SchedulerMixin):
            components[name] = cls.from_config(cls.load_config(path / name))
        else:
            components[name] = None
    if "requires_safety_checker" in accepted:
        components["requires_safety_checker"] = False  # nothing runs here; silences the warning
    return pipe_cls(**components)
