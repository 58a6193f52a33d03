"""Tiny random causal LMs of several families, deterministic per seed, for fast exact tests.

Every model uses the SmolLM2 tokenizer (vocab 49152, ChatML chat template) so it tokenizes
real text (``MMSERVE_TINY_TOKENIZER`` names another tokenizer directory, e.g. where the SmolLM2
package is not installed), has 4 query heads / 2 KV heads (GQA) of head_dim 32, and weights drawn from
N(0, 0.2) so greedy argmax is far from ties (tests compare tokens exactly with
``transformers.generate``). Same arch + seed gives byte-identical safetensors.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from engine.cachedir import build_once  # noqa: E402
from engine.model_loader import DEFAULT_LLM, cache_root, resolve_model_path  # noqa: E402
from engine.tiny_archs import ARCHS  # noqa: E402

WEIGHT_STD = 0.2
NORM_STD = 0.1

_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    initializer_range=WEIGHT_STD,
)


def _tokenizer():
    path = os.environ.get("MMSERVE_TINY_TOKENIZER") or resolve_model_path(DEFAULT_LLM)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _reinit_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter from a seeded generator: matrices and biases N(0, WEIGHT_STD),
    norm weights perturbed by N(0, NORM_STD) around their default (1, or 0 for Gemma's 1+w)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim >= 2 or name.endswith("bias"):
                param.copy_(noise * WEIGHT_STD)
            else:  # 1-D norm weight
                param.add_(noise * NORM_STD)


def make_tiny(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random ``arch`` causal LM (safetensors, fp32) plus tokenizer to ``out_dir``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    out = Path(out_dir)
    tokenizer = _tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    ids["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = {**_COMMON, **ARCHS[arch]}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs, vocab_size=len(tokenizer), **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_(model, seed * 1_000_003 + zlib.crc32(arch.encode()))  # distinct weights per family
    model.generation_config = GenerationConfig(**ids)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    return out


def tiny_model_dir(arch: str, seed: int = 0) -> Path:
    """A cached tiny model under ``$MMSERVE_CACHE/tiny/<arch>-<seed>``: made once, then reused."""
    return build_once(
        cache_root() / "tiny" / f"{arch}-{seed}", "model.safetensors", lambda tmp: make_tiny(arch, tmp, seed)
    )
