"""Apply a :class:`~.plans.CPPlan` to a model with forward hooks (the model code is unchanged)."""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modalities.diffusion.parallel.attention import ShardedAttention, activate, deactivate, install_sdpa_interceptor
from modalities.diffusion.parallel.comm import CPGroups
from modalities.diffusion.parallel.plans import CPPlan, Split, plan_for


@dataclass
class CPHandle:
    """Hooks installed on one model; :meth:`remove` restores plain single-process behaviour."""

    groups: CPGroups
    attention: ShardedAttention
    handles: list[Any] = field(default_factory=list)
    attention_modules: list[str] = field(default_factory=list)
    forward_batches: list[int] = field(default_factory=list)  # batch size of each model forward since reset
    # sharded attention calls of each model forward (fewer than the model's layers when a step
    # cache skipped blocks)
    forward_layers: list[int] = field(default_factory=list)

    def reset_forwards(self) -> None:
        self.forward_batches.clear()
        self.forward_layers.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _check(x: torch.Tensor, spec: Split, where: str) -> bool:
    """True if ``x`` should be split/gathered; raises on an unexpected layout unless optional."""
    if spec.expected_dims is None or x.dim() == spec.expected_dims:
        return True
    if spec.optional:
        return False
    raise ValueError(f"context parallelism: {where} has {x.dim()} dims, the plan expects {spec.expected_dims}")


def _map_output(output: Any, specs: dict[int | None, Split], fn, where: str) -> Any:
    if None in specs:
        return fn(output, specs[None], where) if isinstance(output, torch.Tensor) else output
    items = list(output)
    for idx, spec in specs.items():
        if isinstance(items[idx], torch.Tensor):
            items[idx] = fn(items[idx], spec, f"{where}[{idx}]")
    return type(output)(items) if isinstance(output, tuple) else items


def _resolve(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    if pattern == "":
        return [("", model)]
    found = [(name, mod) for name, mod in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)]
    # fnmatch's * also matches dots: keep only names with the pattern's depth.
    depth = pattern.count(".")
    return [(n, m) for n, m in found if n.count(".") == depth]


def apply_context_parallel(model: nn.Module, groups: CPGroups, plan: CPPlan | None = None) -> CPHandle:
    """Install ``plan`` (default: the model class's plan from :data:`~.plans.PLANS`) on ``model``.

    Every rank must apply the same plan to an identical model and call it with identical full-size
    inputs; each then computes its chunk of the sequence and the gathered outputs are identical on
    all ranks (bit-for-bit, since they are copies of the same tensors).
    """
    plan = plan or plan_for(model)
    install_sdpa_interceptor()
    handle = CPHandle(groups=groups, attention=ShardedAttention(groups))

    def split_tensor(x: torch.Tensor, spec: Split, where: str) -> torch.Tensor:
        return groups.split(x, spec.dim) if _check(x, spec, where) else x

    def gather_tensor(x: torch.Tensor, spec: Split, where: str) -> torch.Tensor:
        return groups.all_gather(x, spec.dim) if _check(x, spec, where) else x

    def must_resolve(pattern: str) -> list[tuple[str, nn.Module]]:
        mods = _resolve(model, pattern)
        if not mods:
            raise ValueError(f"context-parallel plan names {pattern!r}, which {type(model).__name__} lacks")
        return mods

    for pattern, specs in plan.split_inputs.items():
        for name, mod in must_resolve(pattern):
            signature = inspect.signature(mod.forward)

            def pre_hook(m, args, kwargs, specs=specs, signature=signature, name=name):
                bound = signature.bind_partial(*args, **kwargs)
                for arg, spec in specs.items():
                    x = bound.arguments.get(arg)
                    if isinstance(x, torch.Tensor):
                        bound.arguments[arg] = split_tensor(x, spec, f"{name or 'model'}({arg})")
                return tuple(bound.args), dict(bound.kwargs)

            handle.handles.append(mod.register_forward_pre_hook(pre_hook, with_kwargs=True))

    for table, fn in ((plan.split_outputs, split_tensor), (plan.gather_outputs, gather_tensor)):
        for pattern, specs in table.items():
            for name, mod in must_resolve(pattern):

                def post_hook(m, args, output, specs=specs, name=name, fn=fn):
                    return _map_output(output, specs, fn, name or "model")

                handle.handles.append(mod.register_forward_hook(post_hook))

    calls_at_start: list[int] = []

    def count_forward(m, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor):
            handle.forward_batches.append(int(x.shape[0]))
            calls_at_start.append(handle.attention.calls)

    def count_layers(m, args, output):
        if calls_at_start:
            handle.forward_layers.append(handle.attention.calls - calls_at_start.pop())

    # Registered first so it runs before the root's own split hook (if any).
    handle.handles.insert(0, model.register_forward_pre_hook(count_forward, with_kwargs=True, prepend=True))
    handle.handles.append(model.register_forward_hook(count_layers))

    tokens: dict[int, Any] = {}
    for pattern in plan.sharded_attention:
        for name, mod in _resolve(model, pattern):

            def attn_pre(m, args, name=name):
                tokens[id(m)] = (activate(handle.attention), handle.attention.calls)

            def attn_post(m, args, output, name=name):
                token, calls_before = tokens.pop(id(m))
                deactivate(token)
                if output is not None and handle.attention.calls == calls_before:
                    # The module computed attention without F.scaled_dot_product_attention: its
                    # output would silently cover only the local keys.
                    raise RuntimeError(f"{name} bypassed scaled_dot_product_attention; cannot shard it")

            handle.handles.append(mod.register_forward_pre_hook(attn_pre))
            handle.handles.append(mod.register_forward_hook(attn_post, always_call=True))
            handle.attention_modules.append(name)
    if plan.sharded_attention and not handle.attention_modules:
        raise ValueError(f"context-parallel plan matched no attention module of {type(model).__name__}")
    return handle
