"""The shared engine and the Whisper ASR engine on a CUDA GPU (skipped where there is none):
greedy tokens equal transformers ``generate()`` run on the same GPU in fp32 (TF32 off), under
chunked prefill, prefix-cache hits and continuous batches of several requests.

CI has no GPU; these run where one is lent. Without the SmolLM2 package (e.g. on such a
machine), ``MMSERVE_TINY_TOKENIZER`` names the tokenizer directory for the tiny models and
``MMSERVE_TEST_WHISPER_CONFIG`` a Whisper directory whose config and tokenizer the random
Whisper is built from.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_engine_correctness import _prompts, _reference, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = "cuda"


@pytest.fixture(autouse=True)
def _fp32_means_fp32():
    """TF32 would round matmul inputs to 10 mantissa bits: not what fp32 exactness compares."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_engine_on_cuda_matches_transformers(tiny_model_dir, arch: str) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    model_dir = tiny_model_dir(arch)
    prompts = _prompts(49152, seed=3, lengths=[57, 5, 130, 33, 91])
    max_new = [24, 31, 9, 40, 17, 12, 20]
    expected = _reference(model_dir, prompts, max_new, CUDA)
    config = EngineConfig(
        model=str(model_dir), device=CUDA, max_num_batched_tokens=48, block_size=16, num_kv_blocks=200
    )
    engine = LLMEngine(config)
    assert engine.runner.device.type == CUDA
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in max_new]
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert got == expected
    assert engine.stats()["prefix_cache_hits"] > 0


def test_seeded_sampling_on_cuda_is_batch_invariant(tiny_model_dir) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), device=CUDA))
    prompts = _prompts(49152, seed=4, lengths=[20, 35, 9])[:3]
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    batch = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    alone = [engine.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert batch == alone and len(set(map(tuple, batch))) == 3


def test_smollm2_on_cuda_matches_transformers(smollm2_dir) -> None:
    """The real SmolLM2 weights (its GGUF file, dequantized to fp32) on the GPU."""
    prompts = _prompts(49152, seed=4, lengths=[150, 37, 80])
    max_new = [20, 16, 12, 10, 14]
    expected = _reference(smollm2_dir, prompts, max_new, CUDA)
    got, stats = _run(smollm2_dir, prompts, max_new, device=CUDA, max_num_batched_tokens=96, num_kv_blocks=40)
    assert got == expected
    assert stats["after"]["prefix_cache_hits"] > 0


def _random_whisper(out: Path) -> Path:
    """A Whisper with the config and tokenizer of a real one and seeded N(0, 0.2) weights."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from engine.tiny_models import _reinit_
    from modalities.asr.model import resolve_asr_path

    src = Path(os.environ.get("MMSERVE_TEST_WHISPER_CONFIG") or resolve_asr_path(None))
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig.from_pretrained(src))
    _reinit_(model, 7)
    model.save_pretrained(out, safe_serialization=True)
    # After saving: the real generation config (task, language, suppressed and timestamp ids).
    for name in ("generation_config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return out


def _clips(weights: str) -> list[np.ndarray]:
    """Real speech (both corpus voices) for the real weights; tones with noise for random ones."""
    from modalities.asr.engine import RATE
    from modalities.asr.speech_corpus import corpus

    if weights == "tiny.en":
        return corpus("piper")[:2] + corpus("espeak")[:2]
    rng = np.random.default_rng(0)
    t = np.arange(RATE * 3) / RATE
    return [
        (0.3 * np.sin(2 * np.pi * f * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
        for f in (220, 330, 440)
    ]


@pytest.mark.parametrize("weights", ["random", "tiny.en"])
async def test_whisper_on_cuda_matches_generate(tmp_path: Path, weights: str) -> None:
    from modalities.asr.engine import AsrConfig, AsrEngine, TranscriptionRequest
    from modalities.asr.model import load_whisper, resolve_asr_path
    from tests.test_asr import generate_tokens

    path = _random_whisper(tmp_path / "whisper") if weights == "random" else resolve_asr_path(weights)
    engine = AsrEngine(load_whisper(str(path), device=CUDA), AsrConfig(max_encoder_batch=4, max_new_tokens=48))
    assert engine.engine.engine.runner.device.type == CUDA
    reference = load_whisper(str(path), device=CUDA)
    clips = _clips(weights)
    prompt = engine.prompt_ids()
    try:
        got = await asyncio.gather(*(engine.decode_tokens(c, prompt) for c in clips))  # one batch
        # The whole request path on the GPU too: fallback checks, stitching, word alignment.
        transcript = await engine.run(TranscriptionRequest(np.concatenate(clips), word_timestamps=True))
    finally:
        await engine.shutdown()
    assert transcript.words is not None and len(transcript.words) == len(transcript.text.split())
    assert all(0 <= w.start <= w.end <= transcript.duration for w in transcript.words)
    for clip, tokens in zip(clips, got, strict=True):
        assert len(tokens) > 5
        assert tokens == generate_tokens(reference, clip, prompt, 48)


async def test_ar_tts_on_cuda_matches_generate_and_streams() -> None:
    from modalities.tts.ar_engine import ARTTSEngine
    from modalities.tts.protocol import TTSRequest
    from modalities.tts.tiny import tiny_tts_ar_dir
    from tests.test_tts_ar import FRAMES, TEXTS, reference_tokens

    model_dir = tiny_tts_ar_dir(seed=0)
    ar = ARTTSEngine.from_dir(model_dir, num_kv_blocks=256, device=CUDA)
    assert ar.engine.engine.runner.device.type == CUDA and ar.codec.device.type == CUDA
    prompts = [ar.prompt_ids(t, v) for t, v in TEXTS]
    got = [o.outputs[0].token_ids for o in ar.engine.engine.generate(prompts, ar.sampling_params(FRAMES))]
    assert got == reference_tokens(model_dir, CUDA)["tts"]
    # Streamed frame by frame through the codec on the GPU: the chunks are the full decode's audio.
    ar.max_frames = FRAMES
    try:
        await ar.start()
        parts = [c async for c in ar.stream(TTSRequest(*TEXTS[0]))]
    finally:
        await ar.shutdown()
    codes = ar.layout.codes(got[0])
    with torch.no_grad():
        full = ar.codec.decode(audio_codes=torch.from_numpy(codes[None]).to(CUDA)).audio_values[0].cpu().numpy()
    assert len(parts) >= 3
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-4)
