"""Int8 weight-only quantization swaps Linear modules and stays close to the fp32 model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.cpu_linear import HalfStoredLinear, PrepackedLinear, fast_linear, onednn_available
from engine.llm_engine import LLMEngine
from engine.native import F16_ISAS, f16_linear, f16_linear_kernel
from engine.quantization import Int8WeightOnlyLinear, quantize
from engine.sampling_params import SamplingParams


def test_int8_linear_error_is_bounded() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    q = Int8WeightOnlyLinear(linear)
    x = torch.randn(5, 64)
    # Per-weight rounding error is at most scale/2, so the output error is bounded by it.
    bound = (q.scales / 2)[None, :] * x.abs().sum(dim=1, keepdim=True)
    assert q.weight.dtype == torch.int8
    assert ((q(x) - linear(x)).abs() <= bound + 1e-5).all()


def test_quantize_swaps_all_but_head_and_rejects_unknown() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert quantize(model, "int8") == 2
    assert all(isinstance(model[i], Int8WeightOnlyLinear) for i in (0, 2))
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(model, "int3")


def test_engine_with_int8_weights_tracks_fp32(tiny_model_dir) -> None:
    model_dir = str(tiny_model_dir("llama"))
    prompts = [[100 + 7 * i + j for j in range(12 + 5 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    fp32 = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64)).generate(prompts, params)
    int8_engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, quantization="int8"))
    assert any(isinstance(m, Int8WeightOnlyLinear) for m in int8_engine.adapter.modules())
    int8 = int8_engine.generate(prompts, params)
    agree = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(fp32, int8, strict=True))
    assert agree >= 5


def test_onednn_linear_swap_keeps_parameters_and_results() -> None:
    from engine.cpu_linear import OneDNNLinear, use_onednn_linears

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
    x = torch.randn(3, 16)
    expected = model(x)
    weight = model[0].weight
    assert use_onednn_linears(model) == 2
    assert isinstance(model[0], OneDNNLinear) and model[0].weight is weight  # same Parameter: ties survive
    got = model(x)
    if onednn_available():
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", [isa for isa in F16_ISAS if f16_linear_kernel(isa) is not None])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_half_stored_kernel_equals_the_fp32_matmul(rows: int, isa: str) -> None:
    """Every build this CPU runs (AVX-512 and AVX2 on an AVX-512 machine)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g).half()
    x, bias = torch.randn(rows, 96, generator=g), torch.randn(200, generator=g)
    torch.testing.assert_close(f16_linear(x, w, bias, isa), x @ w.float().T + bias, rtol=1e-5, atol=1e-5)
    # A row's result does not depend on the rows batched with it.
    alone = torch.cat([f16_linear(x[i : i + 1], w, isa=isa) for i in range(rows)])
    assert torch.equal(alone, f16_linear(x, w, isa=isa))


@pytest.mark.skipif(f16_linear_kernel() is None or not onednn_available(), reason="no F16C kernel or no oneDNN")
def test_fast_linear_keeps_an_fp16_copy_only_of_fp16_exact_weights() -> None:
    torch.manual_seed(0)
    exact, other = nn.Linear(96, 200), nn.Linear(96, 200)
    exact.weight.data = exact.weight.data.half().float()
    fast = fast_linear(exact)
    assert isinstance(fast, HalfStoredLinear) and type(fast_linear(other)) is PrepackedLinear
    for rows in (2, 9):  # the fp16 kernel, then oneDNN past max_rows
        x = torch.randn(rows, 96)
        torch.testing.assert_close(fast(x), exact(x), rtol=1e-5, atol=1e-5)
