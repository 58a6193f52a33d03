"""A tiny random autoregressive TTS model ("an LLM wearing a hat") for tests and benchmarks.

No such weights ship offline, so ``make_tiny_tts_ar`` writes, deterministically per seed:

- ``DIR/``: a Llama causal LM (the tiny-model shape from ``engine.tiny_models``) whose
  vocabulary is the SmolLM2 text vocabulary extended with special tokens ``<|audio_start|>``,
  ``<|audio_end|>``, one ``<|voice:NAME|>`` per voice, and ``num_codebooks * codebook_size`` codec
  tokens ``<|c{q}_{code}|>``; loaded by the engine's ordinary loader like any HF directory;
- ``DIR/codec/``: a small random-initialised DAC codec (transformers ``DacModel``), 24 kHz, 75
  frames/s, ``num_codebooks`` codebooks;
- ``DIR/mmserve_tts.json``: the token layout (``ARTTSLayout``).

A prompt is ``<|voice:V|> text <|audio_start|>``; the model then emits one token per codebook per
frame (frame-major, codebook ``q`` of a frame at ``codec_offset + q * codebook_size + code``)
and ``<|audio_end|>``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

TTS_CONFIG = "mmserve_tts.json"
VOICES = ("tiny-a", "tiny-b")
CODEBOOK_SIZE = 256
NUM_CODEBOOKS = 2


def _codec_config() -> object:
    from transformers import DacConfig

    return DacConfig(
        encoder_hidden_size=8,
        decoder_hidden_size=64,
        hidden_size=32,
        codebook_size=CODEBOOK_SIZE,
        n_codebooks=NUM_CODEBOOKS,
        codebook_dim=8,
        downsampling_ratios=[2, 4, 5, 8],
        upsampling_ratios=[8, 5, 4, 2],
        hop_length=320,
        sampling_rate=24_000,
    )


def measure_context_frames(codec: object, num_codebooks: int, codebook_size: int, frames: int = 64) -> int:
    """Frames on each side that one frame's code influences in the decoder's output (measured by
    perturbing the middle frame); the streaming decoder keeps this much context."""
    import torch

    hop = int(codec.config.hop_length)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, codebook_size, (1, num_codebooks, frames), generator=gen)
    changed = codes.clone()
    changed[0, :, frames // 2] = (changed[0, :, frames // 2] + 1) % codebook_size
    with torch.no_grad():
        a = codec.decode(audio_codes=codes).audio_values[0]  # type: ignore[attr-defined]
        b = codec.decode(audio_codes=changed).audio_values[0]  # type: ignore[attr-defined]
    idx = ((a - b).abs() > 0).nonzero().flatten()
    reach = max(frames // 2 - int(idx.min()) // hop, int(idx.max()) // hop - frames // 2)
    if reach >= frames // 2 - 1:
        raise ValueError("the codec's receptive field is too wide to measure (recurrent decoder?)")
    return reach + 1


def make_tiny_tts_ar(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny AR TTS model, its codec and its layout to ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DacModel, GenerationConfig

    from engine.tiny_models import _COMMON, _reinit_, _tokenizer

    out = Path(out_dir)
    tokenizer = _tokenizer()
    text_vocab = len(tokenizer)
    voice_tokens = [f"<|voice:{v}|>" for v in VOICES]
    codec_tokens = [f"<|c{q}_{i}|>" for q in range(NUM_CODEBOOKS) for i in range(CODEBOOK_SIZE)]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|audio_start|>", "<|audio_end|>", *voice_tokens, *codec_tokens]},
        replace_extra_special_tokens=False,
    )
    ids = tokenizer.convert_tokens_to_ids
    layout = {
        "audio_start_id": ids("<|audio_start|>"),
        "audio_end_id": ids("<|audio_end|>"),
        "voices": {v: ids(t) for v, t in zip(VOICES, voice_tokens, strict=True)},
        "codec_offset": ids(codec_tokens[0]),
        "codebook_size": CODEBOOK_SIZE,
        "num_codebooks": NUM_CODEBOOKS,
        "codec_dir": "codec",
        "temperature": 0.0,
    }
    assert layout["codec_offset"] == text_vocab + 2 + len(VOICES)
    assert ids(codec_tokens[-1]) == layout["codec_offset"] + NUM_CODEBOOKS * CODEBOOK_SIZE - 1

    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=layout["audio_end_id"])
    special["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = AutoConfig.for_model("llama", **_COMMON, tie_word_embeddings=False, vocab_size=len(tokenizer), **special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_(model, seed * 1_000_003 + zlib.crc32(b"tts-ar"))
    model.generation_config = GenerationConfig(**special)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)

    torch.manual_seed(seed + 1)
    codec = DacModel(_codec_config()).eval()
    codec.save_pretrained(out / layout["codec_dir"], safe_serialization=True)
    layout["context_frames"] = measure_context_frames(codec, NUM_CODEBOOKS, CODEBOOK_SIZE)
    (out / TTS_CONFIG).write_text(json.dumps(layout, indent=2) + "\n")
    return out


def tiny_tts_ar_dir(seed: int = 0) -> Path:
    """A cached tiny AR TTS model under ``$MMSERVE_CACHE/tiny/tts-ar-<seed>``: made once, then reused."""
    from engine.cachedir import build_once
    from engine.model_loader import cache_root

    return build_once(cache_root() / "tiny" / f"tts-ar-{seed}", TTS_CONFIG, lambda tmp: make_tiny_tts_ar(tmp, seed))
