"""Weight-only quantization as module swaps: the model code never knows (gpt-fast style)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Int8WeightOnlyLinear(nn.Module):
    """``nn.Linear`` with int8 weights and one fp scale per output channel (symmetric).
    Halves weight memory against bf16 (quarters it against fp32); activations stay in float."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0).to(w.dtype)
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight.to(x.dtype)) * self.scales
        return out if self.bias is None else out + self.bias


QUANTIZERS: dict[str, Callable[[nn.Linear], nn.Module]] = {"int8": Int8WeightOnlyLinear}


def quantize(model: nn.Module, method: str, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Swap every ``nn.Linear`` (except names containing ``skip``) in place; returns the count.
    The output head stays in float: it is tied to the embeddings in most small models."""
    if method not in QUANTIZERS:
        raise ValueError(f"unknown quantization {method!r}; choose from {sorted(QUANTIZERS)}")
    make = QUANTIZERS[method]
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(s in name for s in skip)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, make(module))
    return len(targets)
