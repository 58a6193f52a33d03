"""Analytic communication volume of context parallelism, and the shapes it depends on.

For one transformer forward with ``L`` sharded attention layers over ``S`` sharded tokens (batch
``B``, ``H`` heads of dimension ``D``, ``e`` bytes per element), let ``E = B*S*H*D*e`` (one full Q)
and ``N = u*r``. Each rank sends (see :mod:`.comm` for the conventions):

- Ulysses: Q, K, V all-to-all in and the output back: ``L * 4E/N * (u-1)/u``;
- ring: K and V (``E/N`` each, after any Ulysses step) passed ``r-1`` hops: ``L * 2(r-1)E/N``;
- gather of the final projection (``S_out`` image tokens of ``C_out`` values): ``B*S_out/N*C_out*e*(N-1)``.

Per rank, Ulysses volume *falls* as ``1/N`` (times ``(u-1)/u``) while ring volume stays ~``2E``: that is
why Ulysses is preferred inside a fast (NVLink) domain and ring across slower links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from modalities.diffusion.parallel.comm import ContextParallelConfig


@dataclass(frozen=True)
class ForwardShape:
    """What one transformer forward looks like to the CP communication."""

    batch: int
    tokens: int  # sharded sequence seen by attention (image/video tokens, plus text for joint attention)
    heads: int
    head_dim: int
    layers: int  # sharded attention calls per forward
    out_tokens: int  # tokens through the gathered final projection
    out_dim: int  # values per token of that projection
    elem_bytes: int = 4

    @property
    def q_bytes(self) -> int:
        return self.batch * self.tokens * self.heads * self.head_dim * self.elem_bytes


def bytes_per_forward(cfg: ContextParallelConfig, s: ForwardShape) -> dict[str, int]:
    """Bytes one rank sends during one forward, by kind (``a2a``, ``ring``, ``gather``)."""
    n, u, r = cfg.world_size, cfg.ulysses_degree, cfg.ring_degree
    local = s.q_bytes // n
    out = {
        "a2a": s.layers * 4 * (local * (u - 1) // u),
        "ring": s.layers * 2 * (r - 1) * local,
        "gather": s.batch * (s.out_tokens // n) * s.out_dim * s.elem_bytes * (n - 1),
    }
    return {k: v for k, v in out.items() if v}


def _patch(cfg: Any) -> tuple[int, ...]:
    p = cfg.get("patch_size", 1) or 1
    return tuple(p) if isinstance(p, (list, tuple)) else (p, p)


def dit_forward_shape(
    denoiser: Any, *, latent_hw: tuple[int, int], latent_frames: int = 1, batch: int, elem_bytes: int = 4
) -> ForwardShape:
    """The :class:`ForwardShape` of a PixArt/Wan-style transformer (self-attention over image/video
    tokens, cross-attention to text) on latents of ``latent_hw`` (and ``latent_frames``)."""
    cfg = denoiser.config
    patch = _patch(cfg)
    ph, pw = patch[-2], patch[-1]
    pt = patch[0] if len(patch) == 3 else 1
    h, w = latent_hw
    if h % ph or w % pw or latent_frames % pt:
        raise ValueError(f"latents {latent_frames}x{h}x{w} do not tile into patches {patch}")
    tokens = (latent_frames // pt) * (h // ph) * (w // pw)
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    out_channels = cfg.get("out_channels", None) or cfg["in_channels"]
    return ForwardShape(
        batch=batch,
        tokens=tokens,
        heads=heads,
        head_dim=head_dim,
        layers=cfg["num_layers"],
        out_tokens=tokens,
        out_dim=out_channels * math.prod(patch),
        elem_bytes=elem_bytes,
    )


def check_divisible(cfg: ContextParallelConfig, s: ForwardShape) -> None:
    """Raise ``ValueError`` (before any communication) unless ``s`` can be sharded by ``cfg``."""
    if s.tokens % cfg.world_size:
        raise ValueError(
            f"context parallelism over {cfg.world_size} ranks needs a token count divisible by {cfg.world_size}; "
            f"this size gives {s.tokens} tokens"
        )
    if s.heads % cfg.ulysses_degree:
        raise ValueError(f"Ulysses degree {cfg.ulysses_degree} does not divide the model's {s.heads} heads")
