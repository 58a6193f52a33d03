"""Tiny random-initialised diffusers pipelines, deterministic per seed, for fast exact tests.

Three archetypes, each written with the real ``save_pretrained`` layout (``model_index.json`` plus
one folder per component) so that ``DiffusionPipeline.from_pretrained(dir)`` loads them exactly as
it loads a real checkpoint:

- ``sd-unet``: ``StableDiffusionPipeline`` (UNet2DConditionModel, AutoencoderKL, CLIP text encoder,
  DDIM), VAE factor 2, UNet downsampling 2: sizes are multiples of 8 px (the pipelines' own check);
- ``dit``: ``PixArtAlphaPipeline`` (PixArtTransformer2DModel, 4 blocks, patch 2; T5 encoder;
  DPM-Solver), VAE factor 2: sizes are multiples of 8 px (the pipelines' own check);
- ``video``: ``WanPipeline`` (WanTransformer3DModel, 4 blocks, patch (1, 2, 2); Wan 3D VAE,
  spatial factor 8, temporal factor 4; UMT5 encoder; UniPC flow matching): sizes are multiples of
  16 px and frame counts are ``4k + 1``.

No hub: every text encoder uses the BERT WordPiece tokenizer of the packaged all-MiniLM-L6-v2
(vocab 30522), saved into the pipeline's ``tokenizer/`` folder. Weights come from the modules'
own initialisers under ``torch.manual_seed(seed + k)``; same arch and seed give byte-identical
files (fp32 safetensors).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

TEXT_LEN = 32  # tokenizer model_max_length: short prompts keep the tiny text encoders cheap


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    from modalities.embed.model import default_embed_path

    tok = AutoTokenizer.from_pretrained(str(default_embed_path()), local_files_only=True)
    tok.model_max_length = TEXT_LEN
    return tok


def _seeded(seed: int, k: int, build: Callable[[], Any]) -> Any:
    """Build one component under its own seed, so a change to one leaves the others' weights alone."""
    torch.manual_seed(seed * 1_000 + k)
    return build().eval()  # fp32: the modules' default dtype


def _t5(tok: Any, seed: int, k: int, umt5: bool = False) -> Any:
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    cfg = config_cls(
        vocab_size=len(tok),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.sep_token_id,
    )
    return _seeded(seed, k, lambda: model_cls(cfg))


def _sd_unet(seed: int) -> Any:
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tok = _tokenizer()
    unet = _seeded(
        seed,
        1,
        lambda: UNet2DConditionModel(
            sample_size=32,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=16,
        ),
    )
    vae = _seeded(
        seed,
        2,
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            block_out_channels=(16, 32),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            norm_num_groups=16,
            sample_size=64,
        ),
    )
    text_cfg = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TEXT_LEN,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,  # CLIP pools at the first EOS (BERT's [SEP])
    )
    text = _seeded(seed, 3, lambda: CLIPTextModel(text_cfg))
    sched = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tok,
        unet=unet,
        scheduler=sched,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _dit(seed: int) -> Any:
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    tok = _tokenizer()
    transformer = _seeded(
        seed,
        1,
        lambda: PixArtTransformer2DModel(
            sample_size=32,
            num_layers=4,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_channels=32,
            in_channels=4,
            out_channels=8,  # learned sigma, as in the real PixArt: the pipeline keeps the first half
            cross_attention_dim=32,
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
        ),
    )
    vae = _seeded(
        seed,
        2,
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            block_out_channels=(16, 32),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            norm_num_groups=16,
            sample_size=64,
        ),
    )
    return PixArtAlphaPipeline(
        tokenizer=tok,
        text_encoder=_t5(tok, seed, 3),
        vae=vae,
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )


def _video(seed: int) -> Any:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    tok = _tokenizer()
    transformer = _seeded(
        seed,
        1,
        lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=8,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=64,
            ffn_dim=64,
            num_layers=4,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64,
        ),
    )
    vae = _seeded(
        seed,
        2,
        lambda: AutoencoderKLWan(
            base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        ),
    )
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(
        tokenizer=tok, text_encoder=_t5(tok, seed, 3, umt5=True), vae=vae, transformer=transformer, scheduler=sched
    )


TINY_PIPELINES: dict[str, Callable[[int], Any]] = {"sd-unet": _sd_unet, "dit": _dit, "video": _video}


def make_tiny(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny random ``arch`` pipeline (``sd-unet``, ``dit``, ``video``) to ``out_dir``."""
    if arch not in TINY_PIPELINES:
        raise ValueError(f"unknown diffusion arch {arch!r}; choose from {', '.join(TINY_PIPELINES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    TINY_PIPELINES[arch](seed).save_pretrained(out, safe_serialization=True)
    return out


def tiny_model_dir(arch: str, seed: int = 0) -> Path:
    """A cached tiny pipeline under ``$MMSERVE_CACHE/tiny/diffusion-<arch>-<seed>``: made once, then reused."""
    from engine.cachedir import build_once
    from engine.model_loader import cache_root

    dst = cache_root() / "tiny" / f"diffusion-{arch}-{seed}"
    return build_once(dst, "model_index.json", lambda tmp: make_tiny(arch, tmp, seed))
