"""The engine's multimodal-ready inputs on a toy model: precomputed input embeddings at given
positions, a per-sequence encoder output for cross-attention, and content-aware prefix caching.
The paged engine must match a dense single-sequence reference of the same toy model."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_adapter import ModelAdapter
from engine.model_loader import LoadedModel
from engine.sampling_params import SamplingParams
from engine.sequence import EmbedInput, PromptInputs

VOCAB, HIDDEN, HEADS, HEAD_DIM = 64, 32, 2, 16


class ToyEncDec(ModelAdapter):
    """One causal self-attention layer (paged, through the backend) then one cross-attention
    layer over the sequence's encoder output, then a vocabulary projection."""

    num_layers, num_kv_heads, head_dim, hidden_size, vocab_size = 1, HEADS, HEAD_DIM, HIDDEN, VOCAB

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.cross_q = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        for p in self.parameters():
            nn.init.normal_(p, std=0.5)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.emb(token_ids)

    def _cross(self, h: torch.Tensor, enc: torch.Tensor | None) -> torch.Tensor:
        if enc is None:
            return h
        return h + F.scaled_dot_product_attention(self.cross_q(h)[None], enc[None], enc[None])[0]

    def forward(self, embeds, positions, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv(embeds).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        h = embeds + backend.forward(0, q, k, v, meta, scale=HEAD_DIM**-0.5).reshape(-1, HIDDEN)
        parts = [
            self._cross(h[meta.query_start[i] : meta.query_start[i + 1]], meta.encoder_outputs[i])
            for i in range(meta.num_seqs)
        ]
        return torch.cat(parts)

    def dense(self, embeds: torch.Tensor, enc: torch.Tensor | None) -> torch.Tensor:
        """Reference: the same math on one whole sequence, no paging."""
        q, k, v = (t.transpose(0, 1) for t in self.qkv(embeds).view(-1, 3, HEADS, HEAD_DIM).unbind(1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(-1, HIDDEN)
        return self._cross(embeds + att, enc)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def _reference_greedy(model: ToyEncDec, inputs: PromptInputs, steps: int) -> list[int]:
    tokens = list(inputs.token_ids)
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            embeds = model.embed(torch.tensor(tokens))
            for e in inputs.embeds:
                embeds[e.offset : e.end] = e.embeds
            nxt = int(model.compute_logits(model.dense(embeds, inputs.encoder_output)[-1]).argmax())
            tokens.append(nxt)
            out.append(nxt)
    return out


def _engine(model: ToyEncDec, **config) -> LLMEngine:
    loaded = LoadedModel(model=None, tokenizer=None, path=Path("."), name="toy", max_model_len=256)  # type: ignore[arg-type]
    return LLMEngine(EngineConfig(model="toy", num_kv_blocks=64, block_size=4, **config), loaded, adapter=model)


def test_embeddings_and_encoder_outputs_match_dense_reference() -> None:
    model = ToyEncDec().eval()
    gen = torch.Generator().manual_seed(1)
    image = EmbedInput(3, torch.randn(5, HIDDEN, generator=gen), "img-a")
    cases = [
        PromptInputs(list(range(1, 12)), embeds=[image]),
        PromptInputs([5, 9, 2, 7], encoder_output=torch.randn(6, HIDDEN, generator=gen)),
        PromptInputs([5, 9, 2, 7], encoder_output=torch.randn(3, HIDDEN, generator=gen)),
        PromptInputs(list(range(20, 37)), embeds=[image]),
        PromptInputs([3, 3, 3]),
    ]
    expected = [_reference_greedy(model, c, 8) for c in cases]
    # A 6-token budget splits prompts into chunks, some cutting through the embedding span.
    engine = _engine(model, max_num_batched_tokens=6)
    outs = engine.generate(cases, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    # Sanity: the inputs matter (different encoder outputs change the answer).
    assert expected[1] != expected[2]


def test_prefix_cache_respects_embedding_content() -> None:
    model = ToyEncDec().eval()
    tokens = list(range(1, 14))
    a = PromptInputs(tokens, embeds=[EmbedInput(0, torch.ones(4, HIDDEN), "img-a")])
    b = PromptInputs(tokens, embeds=[EmbedInput(0, -torch.ones(4, HIDDEN), "img-b")])
    engine = _engine(model)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first_a = engine.generate([a], params)[0]
    out_b = engine.generate([b], params)[0]
    assert out_b.num_cached_tokens == 0  # same tokens, other image: no reuse
    again_a = engine.generate([a], params)[0]
    assert again_a.num_cached_tokens == 12
    assert again_a.outputs[0].token_ids == first_a.outputs[0].token_ids
    assert out_b.outputs[0].token_ids == _reference_greedy(model, b, 4)
