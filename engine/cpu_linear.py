"""oneDNN linear layers for fp32 on CPU, as an in-place module swap (models stay unaware).

torch's default fp32 ``F.linear`` goes through MKL sgemm; oneDNN's matmul, which torch ships
as ``mkldnn::_linear_pointwise``, uses both cores much better at decode-sized batches
(measured here at 2 threads: 1.5x at M=26, 2x for the 49k-wide output head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.native import f16_linear, f16_linear_kernel


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through oneDNN's matmul (fp32 CPU tensors)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose forward runs oneDNN's matmul; same parameters, same results up to
    fp32 summation order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.weight, self.bias)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into a ``OneDNNLinear`` in place (class swap:
    parameters and weight tying are untouched). Returns how many were swapped."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            count += 1
    return count


class PrepackedLinear(nn.Module):
    """Inference-only replacement of an ``nn.Linear`` whose weight lives prepacked in oneDNN's
    blocked layout (no per-call reorder). The original weight is not kept."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = prepack_onednn_weight(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, self.bias)


class HalfStoredLinear(PrepackedLinear):
    """A ``PrepackedLinear`` whose fp32 weight is exactly a tensor of fp16 values (a model converted
    from an fp16 checkpoint): batches of up to ``max_rows`` rows read an fp16 copy of it with a
    native kernel (half the bytes, fp32 arithmetic; ``engine.native.f16_linear``), larger ones
    the prepacked weight (compute-bound, where oneDNN wins). Only the summation order differs."""

    max_rows = 4  # measured: the kernel's edge shrinks to nothing near 8 rows (docs/BENCHMARKS.md)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.half = linear.weight.detach().half().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.max_rows * self.in_features:
            return f16_linear(x, self.half, self.bias)
        return super().forward(x)


def fast_linear(linear: nn.Linear) -> nn.Module:
    """The fastest exact stand-in for an inference-only fp32 ``linear`` on this CPU:
    ``HalfStoredLinear`` when its weight is fp16-exact and the kernel runs here, else
    ``PrepackedLinear`` (else ``linear`` itself)."""
    w = linear.weight
    if not prepackable(w):
        return linear
    exact = w.shape[1] % 16 == 0 and torch.equal(w.detach().half().float(), w.detach())
    return HalfStoredLinear(linear) if exact and f16_linear_kernel() is not None else PrepackedLinear(linear)


def prepackable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can live prepacked for oneDNN (fp32, on the CPU, oneDNN present)."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and onednn_available()


def use_prepacked_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` whose weight is ``prepackable`` by a
    ``PrepackedLinear`` (for models that only run inference and do not tie linear weights).
    Returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and prepackable(child.weight):
                setattr(module, name, PrepackedLinear(child))
                count += 1
    return count


def prepack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered once into oneDNN's blocked layout (an opaque mkldnn tensor
    that only ``onednn_linear`` reads). A plain weight is reordered by oneDNN on every call.
    Returns ``weight`` itself where this torch build cannot prepack."""
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
