"""First-block cache that decides per request, so batched requests get exactly their solo output.

diffusers' ``apply_first_block_cache`` (ParaAttention's FBCache) takes one skip decision for the
whole batch: the mean relative change of the first block's residual over every row. Batched with
other requests, a request could then skip a step it would have computed alone, or the reverse.
This is the same algorithm written as diffusers ``ModelHook``s (same registry metadata, same
per-context state through ``cache_context``), with the decision taken per *request*: rows
``i, i + B, i + 2B, ...`` of a call with ``B`` requests (CFG pipelines concatenate
``[uncond, cond]``; a request alone has all its rows in one group, as in diffusers).

- Every row group whose relative change exceeds the threshold is *computed*; the others *skip*.
- When every group skips, the remaining blocks pass their input through (the saving) and the
  head returns ``head_output + cached tail residual``, as diffusers does.
- Otherwise the remaining blocks run on the whole batch; the tail then gives the skipping rows
  ``head_output + cached tail residual`` (what they would get alone) and refreshes the cached
  residuals of the computed rows only. A group's reference residual also moves only when it computes.

At ``B = 1`` this is diffusers' first-block cache (``tests/test_diffusion.py`` checks it).

Under context parallelism every rank sees ``1/N`` of the tokens, so a decision from the local
residual alone could differ between ranks (and one rank skipping the blocks while another runs their
collectives would hang them). ``BatchFBCConfig.reduce`` (an all-reduce sum over the ranks) makes the
per-group change and scale global: the shards are equal, so the sum of the ranks' means is ``N``
times the whole sequence's mean for both, and every rank takes the single-process decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_HEAD = "mmserve_fbc_head"
_BLOCK = "mmserve_fbc_block"


@dataclass
class BatchFBCConfig:
    """``threshold`` as in diffusers' ``FirstBlockCacheConfig``; ``requests``: how many requests
    the next pipeline call carries (set by the engine before each batch); ``reduce``: sums a tensor
    over the context-parallel ranks (``None`` in one process)."""

    threshold: float = 0.05
    requests: int = 1
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


def _rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.view(-1, *([1] * (like.ndim - 1)))


def _split(out: Any, meta: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(out, tuple):
        return out, None
    enc = meta.return_encoder_hidden_states_index
    return out[meta.return_hidden_states_index], (out[enc] if enc is not None else None)


def _join(out: Any, meta: Any, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    if not isinstance(out, tuple):
        return hidden
    parts = list(out)
    parts[meta.return_hidden_states_index] = hidden
    if meta.return_encoder_hidden_states_index is not None:
        parts[meta.return_encoder_hidden_states_index] = encoder
    return tuple(parts)


def _hooks() -> tuple[type, type, type]:
    from diffusers.hooks import ModelHook
    from diffusers.hooks._helpers import TransformerBlockRegistry
    from diffusers.hooks.hooks import BaseState
    from diffusers.utils.torch_utils import unwrap_module

    class State(BaseState):
        def __init__(self) -> None:
            self.reset()

        def reset(self) -> None:
            self.prev: torch.Tensor | None = None  # per row: head residual at its last computed step
            self.head_out: tuple[torch.Tensor, torch.Tensor | None] | None = None
            self.tail_res: tuple[torch.Tensor, torch.Tensor | None] | None = None
            self.compute: torch.Tensor | None = None  # bool per row, this call

    class _Block(ModelHook):
        def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
            self.meta = TransformerBlockRegistry.get(unwrap_module(module).__class__)
            return module

    class Head(_Block):
        _is_stateful = True

        def __init__(self, states: Any, config: BatchFBCConfig) -> None:
            super().__init__()
            self.states, self.config = states, config

        def _decide(self, res: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
            rows = res.shape[0]
            groups = self.config.requests if rows % max(1, self.config.requests) == 0 else rows
            change = (res - prev).abs().reshape(rows, -1).mean(1).reshape(rows // groups, groups).mean(0)
            scale = prev.abs().reshape(rows, -1).mean(1).reshape(rows // groups, groups).mean(0)
            if self.config.reduce is not None:  # one decision on every rank (see the module docstring)
                change, scale = self.config.reduce(torch.stack([change, scale])).unbind(0)
            return (change / scale > self.config.threshold).repeat(rows // groups)

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            h_in = self.meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
            out = self.fn_ref.original_forward(*args, **kwargs)
            h_out, e_out = _split(out, self.meta)
            res = h_out - h_in
            st = self.states.get_state()
            first = st.prev is None or st.prev.shape != res.shape or st.tail_res is None
            st.compute = torch.ones(res.shape[0], dtype=torch.bool) if first else self._decide(res, st.prev)
            if not bool(st.compute.any()):
                e_new = None if e_out is None else e_out + st.tail_res[1]
                return _join(out, self.meta, h_out + st.tail_res[0], e_new)
            st.prev = res if first else torch.where(_rows(st.compute, res), res, st.prev)
            st.head_out = (h_out, e_out)
            return out

        def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
            self.states.reset()
            return module

    class Rest(_Block):
        def __init__(self, states: Any, is_tail: bool) -> None:
            super().__init__()
            self.states, self.is_tail = states, is_tail

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            st = self.states.get_state()
            if not bool(st.compute.any()):  # every request skips: pass the input through
                hidden = self.meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
                if self.meta.return_encoder_hidden_states_index is None:
                    return hidden
                enc = self.meta._get_parameter_from_args_kwargs("encoder_hidden_states", args, kwargs)
                return _join((None, None), self.meta, hidden, enc)
            out = self.fn_ref.original_forward(*args, **kwargs)
            if not self.is_tail:
                return out
            h_out, e_out = _split(out, self.meta)
            h_head, e_head = st.head_out
            h_res = h_out - h_head
            e_res = None if e_out is None else e_out - e_head
            if st.tail_res is None or bool(st.compute.all()):
                st.tail_res = (h_res, e_res)
                return out
            m = _rows(st.compute, h_out)
            old_h, old_e = st.tail_res
            h_out = torch.where(m, h_out, h_head + old_h)  # skipping rows: what they would get alone
            if e_out is not None:
                e_out = torch.where(_rows(st.compute, e_out), e_out, e_head + old_e)
                e_res = torch.where(_rows(st.compute, e_res), e_res, old_e)
            st.tail_res = (torch.where(m, h_res, old_h), e_res)
            return _join(out, self.meta, h_out, e_out)

    return State, Head, Rest


def apply_batch_fbc(denoiser: torch.nn.Module, config: BatchFBCConfig) -> None:
    """Install the hooks on ``denoiser``'s transformer blocks (first = head, last = tail)."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.hooks import StateManager

    from modalities.diffusion.cache import denoiser_blocks

    state_cls, head_cls, rest_cls = _hooks()
    states = StateManager(state_cls)
    blocks = denoiser_blocks(denoiser)
    if len(blocks) < 2:
        raise ValueError("first-block caching needs a denoiser with at least two transformer blocks")
    HookRegistry.check_if_exists_or_initialize(blocks[0]).register_hook(head_cls(states, config), _HEAD)
    for i, block in enumerate(blocks[1:], start=2):
        hook = rest_cls(states, is_tail=i == len(blocks))
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, _BLOCK)


def remove_batch_fbc(denoiser: torch.nn.Module) -> None:
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(denoiser)
    registry.remove_hook(_HEAD, recurse=True)
    registry.remove_hook(_BLOCK, recurse=True)
