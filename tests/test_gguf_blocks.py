"""A GGUF file's own Q4_1/Q8_0 blocks: the kernel computes the dequantized weight's matmul, every
served block is proven equal to its fp32 weight, and the engine on them still decodes exactly
what transformers does on the fp32 model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.gguf_blocks import BlockWeight, model_blocks
from engine.llm_engine import LLMEngine
from engine.model_loader import gguf_parsed_once, smollm2_gguf_path
from engine.native import BLOCKQ_ISAS, blockq_linear, blockq_linear_kernel

needs_kernel = pytest.mark.skipif(blockq_linear_kernel() is None, reason="no AVX2/FMA or no C compiler")


def _random_blocks(fmt: int, n: int, k: int, seed: int) -> BlockWeight:
    g = torch.Generator().manual_seed(seed)
    nb = k // 32
    if fmt == 1:
        q = torch.randint(0, 256, (n, nb, 16), generator=g, dtype=torch.uint8)
        m = -torch.rand(n, nb, generator=g) * 0.05
    else:
        q = torch.randint(-127, 128, (n, nb, 32), generator=g, dtype=torch.int8).view(torch.uint8)
        m = None
    d = torch.rand(n, nb, generator=g) * 0.01
    w = BlockWeight(fmt, q, d, m, torch.empty(0))
    w.dense = w.dequantize()
    return w


ISAS = [isa for isa in BLOCKQ_ISAS if blockq_linear_kernel(isa) is not None]
SMALL_M = 8  # the kernel's per-block path up to this many rows, its staged path above


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 30])
def test_kernel_equals_the_dequantized_matmul(fmt: int, rows: int, isa: str) -> None:
    """Every build this CPU runs (AVX-512 and AVX2 on an AVX-512 machine), both paths; 202 output
    rows: the staged path's last group is partial."""
    w = _random_blocks(fmt, 202, 96, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(202)
    torch.testing.assert_close(blockq_linear(x, w, bias, isa), x @ w.dense.T + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", [0, 1])
def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(fmt: int, isa: str) -> None:
    """Within each path: single rows against batches of up to SMALL_M, and slices of more than
    SMALL_M rows (any offset, any remainder of the row groups) against the whole batch."""
    w = _random_blocks(fmt, 202, 96, seed=11)
    x = torch.randn(41, 96, generator=torch.Generator().manual_seed(3))
    small = blockq_linear(x[:SMALL_M], w, isa=isa)
    assert torch.equal(torch.cat([blockq_linear(x[i : i + 1], w, isa=isa) for i in range(SMALL_M)]), small)
    whole = blockq_linear(x, w, isa=isa)
    for a, b in [(0, 9), (5, 17), (3, 33), (30, 41)]:
        assert torch.equal(blockq_linear(x[a:b], w, isa=isa), whole[a:b])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", [0, 1])
def test_the_staged_path_multiplies_by_the_exact_dequantized_weights(fmt: int, isa: str) -> None:
    """The identity as input returns the staged weights themselves: bit for bit the loader's fp32
    weights (Q4_1's d * q + m rounded after the product, as torch computes it)."""
    w = _random_blocks(fmt, 202, 96, seed=5)
    assert torch.equal(blockq_linear(torch.eye(96), w, isa=isa), w.dense.T)


def test_blocks_are_the_exact_fp32_weights(smollm2_dir) -> None:
    from engine.model_loader import load_model

    model = load_model(str(smollm2_dir)).model
    blocks = model_blocks(model, smollm2_gguf_path())
    linears = [n for n, _ in model.named_parameters() if n.endswith("_proj.weight")]
    assert sorted(blocks) == sorted([*linears, "lm_head.weight"])  # q/k rows found under llama.cpp's order
    assert {b.fmt for n, b in blocks.items() if n != "lm_head.weight"} == {1} and blocks["lm_head.weight"].fmt == 0
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(blocks[name].dequantize(), model.get_parameter(name))
    # One weight off by one ulp has no exact blocks: it stays fp32.
    model.get_parameter(name).data[5, 7] = torch.nextafter(model.get_parameter(name)[5, 7], torch.tensor(1.0))
    assert name not in model_blocks(model, smollm2_gguf_path())


def test_block_table_is_parsed_once_then_cached(tmp_path, monkeypatch) -> None:
    """The table of the file's quantized tensors (names, formats, shapes, byte ranges) comes from
    ``GGUFReader`` once, then from the cache; its byte ranges are the reader's tensor data."""
    import gguf

    from engine.gguf_blocks import block_tensors

    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path))
    path = smollm2_gguf_path()
    with gguf_parsed_once():  # (the table's parse is the reader the test reads)
        table = block_tensors(path)
        reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    quantized = [n for n, t in reader.items() if t.tensor_type.name in ("Q4_1", "Q8_0") and len(t.shape) == 2]
    assert [row[0] for row in table] == quantized and len(list((tmp_path / "gguf-tables").iterdir())) == 1
    data = np.memmap(path, mode="r")
    for name, _fmt, n, _k, offset, size in table[:3]:
        assert np.array_equal(data[offset : offset + size].reshape(n, -1), reader[name].data)
    monkeypatch.setattr(gguf, "GGUFReader", None)  # a second call must not parse the file again
    assert block_tensors(path) == table


def test_gguf_quantization_needs_a_gguf_model(tiny_model_dir) -> None:
    from engine.fast_decoder import FastDecoderLM

    model_dir = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="gguf"):
        LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=16, quantization="gguf"))
    auto = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=16, quantization="auto")).adapter
    assert isinstance(auto, FastDecoderLM) and not isinstance(auto.lm_head, BlockWeight)
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(model=model_dir, quantization="int3")
