"""Whisper's decoder as an engine ``ModelAdapter``: self-attention through the engine's paged KV
backend, cross-attention over each sequence's encoder output.

The weights are transformers' ``WhisperForConditionalGeneration``'s (the layers' linears run
through ``fast_linear``: prepacked, or an fp16 copy where the weights are fp16 values), and the
math follows its modules op for op (q scaled after the projection, attention with scale 1), so
greedy tokens match ``generate()``. Cross-attention K/V depend only on the encoder output: they
are computed once per sequence, on its first step, with one fused matmul for all layers, and kept
until the encoder-output tensor is released (the request finished) — a weakref finaliser drops
the cache entry.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from engine.attention import AttentionBackend, AttentionMetadata
from engine.cpu_linear import fast_linear
from engine.model_adapter import ModelAdapter


@dataclass
class _Layer:
    ln1: nn.LayerNorm
    qkv: nn.Module
    o: nn.Module
    ln2: nn.LayerNorm
    cq: nn.Module
    co: nn.Module
    ln3: nn.LayerNorm
    fc1: nn.Module
    fc2: nn.Module


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Module:
    """``fast_linear`` of the linear ``weight``, ``bias`` (tensors shared, not copied; tiny.en's
    are fp16 values, so decode-sized batches read an fp16 copy: ~2x less time in the layers'
    linears at one row)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    lin.weight, lin.bias = nn.Parameter(weight, requires_grad=False), nn.Parameter(bias, requires_grad=False)
    return fast_linear(lin)


class WhisperDecoderAdapter(ModelAdapter):
    """Contract as ``ModelAdapter``; every sequence must carry ``encoder_output`` [frames, d_model]
    (the Whisper encoder's last hidden state for its 30 s window)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        dec = model.model.decoder
        self.model = model  # keeps the weights alive
        self.num_layers = cfg.decoder_layers
        self.num_heads = self.num_kv_heads = cfg.decoder_attention_heads
        self.hidden_size = cfg.d_model
        self.head_dim = cfg.d_model // cfg.decoder_attention_heads
        self.vocab_size = cfg.vocab_size
        self.scaling = self.head_dim**-0.5
        self.act = ACT2FN[cfg.activation_function]
        self.embed_tokens = dec.embed_tokens
        self.embed_scale = cfg.d_model**0.5 if cfg.scale_embedding else 1.0
        self.pos = dec.embed_positions.weight
        self.final_ln = dec.layer_norm
        self.lm_head = model.get_output_embeddings().weight
        # The 51k-row output head is most of a decode step; plain F.linear (MKL) reads it at a
        # fraction of memory speed at M=1, oneDNN with the weight prepacked once ~5x faster, and
        # an fp16 copy (the converted checkpoints are fp16) halves the bytes again. The plain
        # weight stays: the token embedding is tied to it.
        out = model.get_output_embeddings()
        head = fast_linear(out)
        self._head = None if head is out else head
        suppress = list(getattr(model.generation_config, "suppress_tokens", None) or [])
        self.suppress = torch.tensor(suppress, dtype=torch.long, device=self.lm_head.device)
        self.layers: list[_Layer] = []
        kv_w, kv_b = [], []
        for ly in dec.layers:
            a, c = ly.self_attn, ly.encoder_attn
            zeros = a.q_proj.bias.new_zeros(a.k_proj.out_features)
            self.layers.append(
                _Layer(
                    ln1=ly.self_attn_layer_norm,
                    qkv=_linear(
                        torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                        torch.cat([a.q_proj.bias, zeros, a.v_proj.bias]),
                    ),
                    o=_linear(a.out_proj.weight, a.out_proj.bias),
                    ln2=ly.encoder_attn_layer_norm,
                    cq=_linear(c.q_proj.weight, c.q_proj.bias),
                    co=_linear(c.out_proj.weight, c.out_proj.bias),
                    ln3=ly.final_layer_norm,
                    fc1=_linear(ly.fc1.weight, ly.fc1.bias),
                    fc2=_linear(ly.fc2.weight, ly.fc2.bias),
                )
            )
            kv_w += [c.k_proj.weight, c.v_proj.weight]
            kv_b += [torch.zeros_like(c.v_proj.bias), c.v_proj.bias]
        # All layers' cross K/V projections as one matmul: [L * 2 * d, d].
        self.w_cross_kv = torch.cat(kv_w)
        self.b_cross_kv = torch.cat(kv_b)
        self._cross: dict[int, torch.Tensor] = {}
        self._stacked: tuple[list[torch.Tensor], torch.Tensor] | None = None  # (batch's cross K/V, stacked)

    # -- cross-attention cache ---------------------------------------------------------------
    def cross_kv(self, enc: torch.Tensor) -> torch.Tensor:
        """[L, 2, H, frames, D] cross-attention keys/values for one encoder output (cached)."""
        key = id(enc)
        kv = self._cross.get(key)
        if kv is None:
            s = enc.shape[0]
            flat = F.linear(enc.to(self.w_cross_kv.dtype), self.w_cross_kv, self.b_cross_kv)  # [S, L*2*d]
            kv = flat.view(s, self.num_layers, 2, self.num_heads, self.head_dim).permute(1, 2, 3, 0, 4).contiguous()
            self._cross[key] = kv
            weakref.finalize(enc, self._forget_cross, key)
        return kv

    def _forget_cross(self, key: int) -> None:
        """An encoder output was freed (its request ended): drop its K/V, and the batch's stacked
        copy if they are in it, rather than holding that memory until the next batched step."""
        kv = self._cross.pop(key, None)
        held = self._stacked
        if kv is not None and held is not None and any(t is kv for t in held[0]):
            self._stacked = None  # a step in flight keeps its own reference

    @property
    def num_cached_cross(self) -> int:
        return len(self._cross)

    # -- ModelAdapter ------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids) * self.embed_scale

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
    ) -> torch.Tensor:
        encs = meta.encoder_outputs
        if len(encs) != meta.num_seqs or any(e is None for e in encs):
            raise ValueError("every Whisper decoder sequence needs an encoder output")
        cross = [self.cross_kv(e) for e in encs]  # type: ignore[arg-type]

        def self_attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return backend.forward(i, q, k, v, meta, scale=1.0)

        return self._layers(embeds + self.pos[positions], self_attn, cross, meta.query_start)

    def _layers(
        self,
        h: torch.Tensor,
        self_attn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        cross: list[torch.Tensor],
        query_start: list[int],
    ) -> torch.Tensor:
        """The decoder layers over ``h`` [T, d] (sequence ``s`` owns rows ``query_start[s]:
        query_start[s + 1]`` and cross-attends ``cross[s]``); returns the final-norm hidden states."""
        t, hd, nh, d = h.shape[0], self.head_dim, self.num_heads, self.hidden_size
        cross_attn = self.cross_attention(cross, query_start, batched=h.device.type != "cpu")
        for i, ly in enumerate(self.layers):
            qkv = ly.qkv(ly.ln1(h))
            q = (qkv[:, :d] * self.scaling).view(t, nh, hd)
            k = qkv[:, d : 2 * d].view(t, nh, hd)
            v = qkv[:, 2 * d :].reshape(t, nh, hd)
            h = h + ly.o(self_attn(i, q, k, v).reshape(t, d))
            cq = (ly.cq(ly.ln2(h)) * self.scaling).view(t, nh, hd).transpose(0, 1)  # [H, T, D]
            h = h + ly.co(cross_attn(i, cq).transpose(0, 1).reshape(t, d))
            h = h + ly.fc2(self.act(ly.fc1(ly.ln3(h))))
        return self.final_ln(h)

    def cross_attention(
        self, cross: list[torch.Tensor], query_start: list[int], batched: bool
    ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """``attend(i, cq)``: layer ``i``'s cross-attention of ``cq`` [H, T, D] (sequence ``s``
        owns columns ``query_start[s]:query_start[s + 1]``) over each sequence's own encoder K/V.

        Not ``batched`` (the CPU's choice): one call per sequence, reading each K/V in place.
        ``batched`` (a GPU's, where a call per sequence is bound by kernel launches): one call for
        the batch, queries padded to the longest span, the sequences' K/V stacked once and reused
        while the batch is the same (a decode step's batch usually is)."""
        spans = list(itertools.pairwise(query_start))
        if not batched or len(cross) == 1 or len({c.shape for c in cross}) > 1:

            def each(i: int, cq: torch.Tensor) -> torch.Tensor:
                out = torch.empty_like(cq)
                for (lo, hi), kv in zip(spans, cross, strict=True):
                    out[:, lo:hi] = F.scaled_dot_product_attention(
                        cq[None, :, lo:hi], kv[i, 0][None], kv[i, 1][None], scale=1.0
                    )[0]
                return out

            return each
        # Compared by identity, holding the tensors: a freed one's id could come back.
        held = self._stacked
        if held is None or len(held[0]) != len(cross) or any(a is not b for a, b in zip(held[0], cross, strict=True)):
            self._stacked = held = (list(cross), torch.stack(cross))  # [S, L, 2, H, frames, D]
        kv, n, width = held[1], len(cross), max(hi - lo for lo, hi in spans)
        rows = torch.tensor(
            [s * width + j for s, (lo, hi) in enumerate(spans) for j in range(hi - lo)], device=kv.device
        )

        def batched(i: int, cq: torch.Tensor) -> torch.Tensor:
            nh, _, hd = cq.shape
            q = cq.new_zeros(nh, n * width, hd)
            q[:, rows] = cq
            out = F.scaled_dot_product_attention(
                q.view(nh, n, width, hd).transpose(0, 1), kv[:, i, 0], kv[:, i, 1], scale=1.0
            )  # [S, H, width, D]
            return out.transpose(0, 1).reshape(nh, n * width, hd)[:, rows]

        return batched

    def prompt_logits(self, encs: list[torch.Tensor], prompts: list[list[int]]) -> torch.Tensor:
        """Raw logits [len(prompts), vocab] (no suppression) after the last token of each prompt,
        each over its own encoder output, from one dense causal pass outside the engine: Whisper
        reads its no-speech probability there, at the ``<|startoftranscript|>`` position, which
        the engine never samples from. One pass for all, so the 51k-row output projection is
        read once, not once per window."""
        starts = [0, *itertools.accumulate(len(p) for p in prompts)]
        dev = self.lm_head.device
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(len(p), device=dev) for p in prompts])

        def self_attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(q)
            for lo, hi in itertools.pairwise(starts):
                qs, ks, vs = (x[lo:hi].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D]
                out[lo:hi] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1.0)[0].transpose(0, 1)
            return out

        cross = [self.cross_kv(e) for e in encs]
        h = self._layers(self.embed(ids) + self.pos[positions], self_attn, cross, starts)
        return self._logits(h[[s - 1 for s in starts[1:]]])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head) if self._head is None else self._head(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._logits(hidden)
        if self.suppress.numel():  # generation_config.suppress_tokens, as generate() applies them
            logits[:, self.suppress] = float("-inf")
        return logits
