"""Models as the runner sees them: embed → forward over flat tokens → logits.

``HFCausalLM`` runs any transformers decoder whose attention goes through transformers'
attention-function registry (Llama, Qwen2/3, Mistral, Gemma, Phi3, ...): we register a paged
attention function and pass the step's metadata down through the model's ``**kwargs``, so the
model code (and its weights, norms, rotary embeddings) is exactly transformers' own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.sampler import VocabSubset

PAGED_ATTN_NAME = "mmserve_paged"


class ModelAdapter(ABC, nn.Module):
    """Contract: ``forward(embeds [T, hidden], positions [T], meta, backend) -> hidden [T, hidden]``
    for a flat batch of tokens from many sequences; attention layers must go through
    ``backend.forward`` with ``meta`` so each token only sees its own sequence's KV.
    ``compute_logits`` maps selected hidden rows to vocabulary logits, ``compute_logits_for`` to
    the logits of a subset of the vocabulary."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def compute_logits_for(self, hidden: torch.Tensor, subset: VocabSubset) -> torch.Tensor:
        """Logits of the tokens ``subset.ids`` only, in that order: ``compute_logits(hidden)``'s
        columns ``subset.index``. Override to compute just those columns."""
        return self.compute_logits(hidden)[:, subset.index.to(hidden.device)]


def _paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [1, H, T, D], k/v [1, Hkv, T, D] → [1, T, H, D]."""
    meta: AttentionMetadata = kwargs["mmserve_meta"]
    backend: AttentionBackend = kwargs["mmserve_backend"]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    out = backend.forward(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        meta,
        scale=scale,
        sliding_window=window,
        softcap=kwargs.get("softcap"),
    )
    return out[None], None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register_paged_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PAGED_ATTN_NAME, _paged_attention)
    AttentionMaskInterface.register(PAGED_ATTN_NAME, _no_mask)


class HFCausalLM(ModelAdapter):
    """Adapter over a transformers ``*ForCausalLM`` (decoder-only, self-attention only)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        register_paged_attention()
        model.set_attn_implementation(PAGED_ATTN_NAME)
        self.model = model
        self.base = model.base_model
        cfg = model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        # A ready 4D mask makes transformers skip building its own (our backend does masking).
        self._dummy_mask = torch.zeros(1, 1, 1, 1, dtype=torch.bool)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(token_ids)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
    ) -> torch.Tensor:
        if any(e is not None for e in meta.encoder_outputs):
            raise NotImplementedError("this model has no cross-attention: encoder outputs are not supported")
        out = self.base(
            inputs_embeds=embeds[None],
            position_ids=positions[None],
            attention_mask=self._dummy_mask,
            use_cache=False,
            mmserve_meta=meta,
            mmserve_backend=backend,
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
