"""Sequence-parallel attention: Ulysses all-to-all, ring attention with online softmax, and both.

Models call ``torch.nn.functional.scaled_dot_product_attention`` (directly, or through diffusers'
``dispatch_attention_fn`` with the native backend). :func:`install_sdpa_interceptor` replaces that
function once, process-wide, by one that behaves exactly like the original unless a context-parallel
attention is *active* in the current context (a contextvar set by the hooks around the attention
modules the plan marks as sequence-sharded). So un-hooked models, cross-attention (whose K/V are the
replicated text tokens) and other threads are unaffected.

Inputs are in SDPA layout ``(batch, heads, local_seq, head_dim)``; every rank holds its own chunk of
the sequence for all heads. Ulysses: all-to-all so that each rank holds ``heads / u`` heads over ``u``
chunks, attend, all-to-all back. Ring: keep Q, pass K/V ``r - 1`` hops around the ring, merging
partial outputs with their log-sum-exp (exact in real arithmetic; fp32 accumulation).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from modalities.diffusion.parallel.comm import CPGroups

_ORIGINAL_SDPA: Callable[..., torch.Tensor] | None = None
_ACTIVE: contextvars.ContextVar[ShardedAttention | None] = contextvars.ContextVar("mmserve_cp_attention", default=None)


def original_sdpa(*args, **kwargs) -> torch.Tensor:
    fn = _ORIGINAL_SDPA or F.scaled_dot_product_attention
    return fn(*args, **kwargs)


def _intercepted_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    impl = _ACTIVE.get()
    if impl is None:
        return original_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None or is_causal or dropout_p or enable_gqa:
        raise NotImplementedError("context-parallel attention supports unmasked, non-causal attention only")
    return impl(query, key, value, scale)


def install_sdpa_interceptor() -> None:
    """Route ``F.scaled_dot_product_attention`` through the CP dispatcher (idempotent)."""
    global _ORIGINAL_SDPA
    if _ORIGINAL_SDPA is None:
        _ORIGINAL_SDPA = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _intercepted_sdpa  # type: ignore[assignment]


def _attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one K/V block and the log-sum-exp of its scores (fp32)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.float()), lse


class ShardedAttention:
    """The attention that replaces SDPA inside a sequence-sharded attention module."""

    def __init__(self, groups: CPGroups) -> None:
        self.groups = groups
        self.calls = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        self.calls += 1
        cfg = self.groups.config
        scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
        if cfg.ulysses_degree > 1:
            if q.size(1) % cfg.ulysses_degree:
                raise ValueError(f"Ulysses degree {cfg.ulysses_degree} does not divide the {q.size(1)} heads")
            # One fused all-to-all for Q, K, V: scatter heads (dim 2 of the stack), gather sequence (dim 3).
            qkv = self.groups.all_to_all(torch.stack([q, k, v]), scatter_dim=2, gather_dim=3)
            q, k, v = qkv.unbind(0)
        out = self._ring(q, k, v, scale) if cfg.ring_degree > 1 else original_sdpa(q, k, v, scale=scale)
        if cfg.ulysses_degree > 1:
            out = self.groups.all_to_all(out, scatter_dim=2, gather_dim=1)
        return out

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        kv = torch.stack([k, v])
        out = lse = None
        hops = self.groups.config.ring_degree
        for hop in range(hops):
            pending = self.groups.ring_shift_start(kv) if hop < hops - 1 else None
            block_out, block_lse = _attention_with_lse(q, kv[0], kv[1], scale)
            if out is None:
                out, lse = block_out, block_lse
            else:
                new_lse = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - new_lse) + block_out * torch.exp(block_lse - new_lse)
                lse = new_lse
            if pending is not None:
                kv, requests = pending
                for req in requests:
                    req.wait()
        assert out is not None
        return out.to(q.dtype)


def activate(impl: ShardedAttention) -> contextvars.Token:
    return _ACTIVE.set(impl)


def deactivate(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)
