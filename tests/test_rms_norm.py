"""The native RMSNorm (``engine.native.rms_norm``) against transformers' ``LlamaRMSNorm``: the same
values up to the order of the sum of squares, any row count and width."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.native import rms_norm, rms_norm_kernel

pytestmark = pytest.mark.skipif(rms_norm_kernel() is None, reason="no AVX2/FMA or no C compiler here")


@pytest.mark.parametrize("rows", [1, 3, 22])
@pytest.mark.parametrize("width", [576, 960, 100, 7])
def test_native_rms_norm_matches_llama_rms_norm(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
    x = torch.randn(rows, width, generator=gen) * 3.0
    with torch.inference_mode():
        want = norm(x)
        got = rms_norm(x, norm.weight.detach(), 1e-5)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Rows are independent: one row alone gives the same bits as within the batch.
    assert torch.equal(rms_norm(x[-1:].contiguous(), norm.weight.detach(), 1e-5), got[-1:])
