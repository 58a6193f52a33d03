"""Greedy decoding on the engine equals transformers ``generate()`` in fp32, token for token,
under mixed prompt lengths, chunked prefill, prefix-cache hits and forced preemption."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.native import blockq_linear_kernel
from engine.sampling_params import SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "gemma", "mistral", "phi3"]


def _prompts(vocab: int, seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]
    # Two prompts sharing a 40-token prefix with the first one: prefix-cache hits.
    prompts += [prompts[0][:40] + [rng.randrange(100, vocab) for _ in range(k)] for k in (3, 17)]
    return prompts


def _reference(model_dir, prompts: list[list[int]], max_new: list[int], device: str = "cpu") -> list[list[int]]:
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.inference_mode():
        for p, k in zip(prompts, max_new, strict=True):
            ids = torch.tensor([p], device=device)
            gen = ref.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p) :].tolist())
    return outs


def _run(model_dir, prompts, max_new, **config) -> tuple[list[list[int]], dict]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), **config))
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in max_new]
    # Submit the shared-prefix prompts after the first ones finished their prefill.
    outs = engine.generate(prompts, params)
    stats = engine.stats()
    again = engine.generate(prompts[-2:], params[-2:])  # fully warm prefix cache
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[-2:]]
    return [o.outputs[0].token_ids for o in outs], {**stats, "after": engine.stats()}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_arch_matches_transformers(tiny_model_dir, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = _prompts(49152, seed=1, lengths=[57, 5, 130, 33, 91])
    max_new = [24, 31, 9, 40, 17, 12, 20]
    expected = _reference(model_dir, prompts, max_new)
    # Small token budget: prefills are chunked and mixed with decodes.
    got, stats = _run(model_dir, prompts, max_new, max_num_batched_tokens=48, block_size=16, num_kv_blocks=200)
    assert got == expected
    assert stats["after"]["prefix_cache_hits"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forced_preemption_loses_nothing(tiny_model_dir, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = _prompts(49152, seed=2, lengths=[70, 45, 100, 28, 66])
    max_new = [40, 48, 30, 56, 44, 20, 35]
    expected = _reference(model_dir, prompts, max_new)
    # 24 blocks of 8 tokens cannot hold the whole batch: sequences get preempted and recomputed.
    got, stats = _run(model_dir, prompts, max_new, max_num_batched_tokens=64, block_size=8, num_kv_blocks=24)
    assert stats["num_preemptions"] > 0
    assert got == expected


def test_no_chunked_prefill_and_no_prefix_cache(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = _prompts(49152, seed=3, lengths=[20, 64, 9])
    max_new = [10, 12, 14, 8, 6]
    expected = _reference(model_dir, prompts, max_new)
    got, stats = _run(
        model_dir,
        prompts,
        max_new,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        model_impl="hf",  # transformers' own modules for a Llama too (the lean path is the default)
    )
    assert got == expected
    assert stats["prefix_cache_hits"] == 0


def test_smollm2_matches_transformers(smollm2_dir) -> None:
    prompts = _prompts(49152, seed=4, lengths=[150, 37, 80])
    max_new = [20, 16, 12, 10, 14]
    expected = _reference(smollm2_dir, prompts, max_new)
    got, stats = _run(smollm2_dir, prompts, max_new, max_num_batched_tokens=96, num_kv_blocks=40, block_size=16)
    assert got == expected
    assert stats["after"]["prefix_cache_hits"] > 0


@pytest.mark.skipif(blockq_linear_kernel() is None, reason="no AVX2/FMA or no C compiler: no block kernel")
def test_smollm2_on_its_gguf_blocks_matches_transformers(smollm2_dir, monkeypatch) -> None:
    """Decode steps and short prefills read the GGUF file's own Q4_1/Q8_0 blocks (the fp32 weights
    transformers runs, stored as the file has them); only the summation order differs."""
    import engine.native
    from engine.gguf_blocks import BlockWeight

    rows_on_blocks: set[int] = set()
    kernel = engine.native.blockq_linear

    def counted(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        rows_on_blocks.add(x.shape[0])
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(engine.native, "blockq_linear", counted)

    prompts = _prompts(49152, seed=4, lengths=[150, 37, 80])
    max_new = [20, 16, 12, 10, 14]
    expected = _reference(smollm2_dir, prompts, max_new)
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), quantization="gguf", num_kv_blocks=40))
    layer = engine.adapter.layers[0]
    assert all(isinstance(w, BlockWeight) for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in max_new]
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == expected
    # One at a time: every decode step is a one-row batch on the blocks; the prompts hit the
    # prefix cache, and the prefills of 9, 11 and 16 new tokens take the kernel's staged path.
    assert [engine.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params, strict=True)] == expected
    assert {1, 9, 11, 16} <= rows_on_blocks
    # Logits of a few columns (allowed_token_ids) read the same head blocks: the same numbers.
    from engine.sampler import vocab_subset

    hidden, subset = torch.randn(2, 576), vocab_subset((5, 77, 4000, 49151))
    full = engine.adapter.compute_logits(hidden)
    assert torch.equal(engine.adapter.compute_logits_for(hidden, subset), full[:, subset.index])


def test_portable_torch_backend_matches_transformers(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen2")
    prompts = _prompts(49152, seed=5, lengths=[41, 7, 66])
    max_new = [15, 22, 9, 12, 18]
    expected = _reference(model_dir, prompts, max_new)
    got, _ = _run(model_dir, prompts, max_new, attention_backend="torch", max_num_batched_tokens=32, num_kv_blocks=64)
    assert got == expected


def test_smollm2_long_prompts_match_transformers(smollm2_dir) -> None:
    """Prompts of 300+ tokens: whole prefills and chunks over cached context (n < L) through the
    prefill attention kernel, 16-row blocks with a partial last one."""
    prompts = _prompts(49152, seed=6, lengths=[523, 307])
    max_new = [12, 10, 8, 9]
    expected = _reference(smollm2_dir, prompts, max_new)
    got, _ = _run(smollm2_dir, prompts, max_new, max_num_batched_tokens=400, num_kv_blocks=96, block_size=16)
    assert got == expected
