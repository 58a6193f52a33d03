"""A lean forward pass for Llama-family decoders (Llama, Qwen2, Qwen3, Mistral without sliding
window), reading the weights of the loaded transformers model.

Same math as transformers' modules, minus their per-module call overhead, with q/k/v and
gate/up each fused into one matmul. At small decode batches that overhead, not the matmuls,
was a third of a step on 2 CPU cores. Other architectures use ``HFCausalLM``.

With oneDNN, weights are prepacked once into oneDNN's blocked layout: given a plain weight,
oneDNN reorders it on every call, which doubled the weight traffic of a memory-bound decode
step (forward 1.35-1.5x faster packed, see docs/BENCHMARKS.md).

Given ``blocks`` (``engine.gguf_blocks.match_blocks``: a GGUF file's own quantized weights, each
proven equal to its fp32 weight), batches of up to ``native.blockq_max_rows()`` rows read those
instead (``native.blockq_linear``; the caller passes blocks only where ``native.blockq_linear_kernel()``
runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from engine.attention import AttentionBackend, AttentionMetadata
from engine.cpu_linear import onednn_available, onednn_linear, prepack_onednn_weight
from engine.gguf_blocks import BlockWeight, cat_blocks
from engine.model_adapter import ModelAdapter
from engine.native import blockq_max_rows, rms_norm, rms_norm_kernel
from engine.sampler import VocabSubset

SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}


def supports(model: nn.Module) -> bool:
    cfg = model.config
    windowed = getattr(cfg, "sliding_window", None) is not None and (
        cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)
    )
    plain = all(type(m) is nn.Linear for m in _linears(model))  # no quantized or swapped modules
    return cfg.model_type in SUPPORTED and not windowed and not getattr(cfg, "mlp_bias", False) and plain


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(("_proj", "lm_head"))]


def _cat_bias(*mods: nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in mods])


@dataclass
class _Layer:
    ln_in: torch.Tensor
    w_qkv: torch.Tensor | BlockWeight
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor | BlockWeight
    b_o: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ln_post: torch.Tensor
    w_gate_up: torch.Tensor | BlockWeight
    w_down: torch.Tensor | BlockWeight


class FastDecoderLM(ModelAdapter):
    def __init__(
        self,
        model: nn.Module,
        use_onednn: bool = True,
        prepack: bool = True,
        blocks: dict[str, BlockWeight] | None = None,
    ) -> None:
        super().__init__()
        cfg = model.config
        base = model.base_model
        self.model = model  # keeps the weights alive and reachable
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.act = ACT2FN[cfg.hidden_act]
        self.rotary = base.rotary_emb
        self.embed_tokens = base.embed_tokens
        self.final_norm = base.norm.weight
        lm_head = model.get_output_embeddings().weight
        onednn = use_onednn and onednn_available() and lm_head.dtype == torch.float32
        # On a CPU, fp32 norms in one native call (torch's rms_norm is ~6 small ops, 61 a step).
        self._native_rms = (
            lm_head.device.type == "cpu" and lm_head.dtype == torch.float32 and rms_norm_kernel() is not None
        )
        self.dense_linear: Callable[..., torch.Tensor] = onednn_linear if onednn else F.linear
        dense = prepack_onednn_weight if onednn and prepack else _same
        found = {id(b.dense): b for b in (blocks or {}).values()}
        self.block_rows = blockq_max_rows() if found else 0  # batches up to this many rows read blocks

        def pack(*weights: torch.Tensor) -> torch.Tensor | BlockWeight:
            """The fused weight, prepacked; with its blocks where every part has them."""
            w = dense(torch.cat(weights) if len(weights) > 1 else weights[0])
            return cat_blocks([found.get(id(p)) for p in weights], w) if found else w

        self._pack = pack
        self.lm_head = pack(lm_head)
        # The lm_head's rows per subset.
        self._subset_heads: dict[tuple[int, ...], torch.Tensor | BlockWeight] = {}
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    ln_in=layer.input_layernorm.weight,
                    w_qkv=pack(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                    b_qkv=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    w_o=pack(a.o_proj.weight),
                    b_o=a.o_proj.bias,
                    q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
                    k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
                    ln_post=layer.post_attention_layernorm.weight,
                    w_gate_up=pack(m.gate_proj.weight, m.up_proj.weight),
                    w_down=pack(m.down_proj.weight),
                )
            )

    def linear(self, x: torch.Tensor, w: torch.Tensor | BlockWeight, b: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, BlockWeight):
            if x.shape[0] <= self.block_rows:
                from engine.native import blockq_linear

                return blockq_linear(x, w, b)
            w = w.dense
        return self.dense_linear(x, w, b)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm (fp32 statistics); torch's rms_norm gives the same bits in
        # one call instead of six, the native kernel the same up to the order of its sum of squares.
        if x.dtype == torch.float32:
            if self._native_rms and x.is_contiguous():
                return rms_norm(x, weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
    ) -> torch.Tensor:
        if any(e is not None for e in meta.encoder_outputs):
            raise NotImplementedError("this model has no cross-attention: encoder outputs are not supported")
        t, hd = embeds.shape[0], self.head_dim
        cos, sin = (c[0].unsqueeze(1) for c in self.rotary(embeds[None], positions[None]))  # [T, 1, D]
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi] bit for bit (only signs move).
        sin = torch.cat((-sin[..., : hd // 2], sin[..., hd // 2 :]), dim=-1)
        nh, nkv = self.num_heads, self.num_kv_heads
        h = embeds.clone()  # the residual stream, updated in place: no new [T, hidden] tensor per add
        for i, ly in enumerate(self.layers):
            qkv = self.linear(self._rms(h, ly.ln_in), ly.w_qkv, ly.b_qkv).view(t, nh + 2 * nkv, hd)
            if ly.q_norm is None:  # q and k rotated together: one set of ops for both
                qk = _rope(qkv[:, : nh + nkv], cos, sin)
                q, k = qk[:, :nh], qk[:, nh:]
            else:
                q = _rope(self._rms(qkv[:, :nh], ly.q_norm), cos, sin)
                k = _rope(self._rms(qkv[:, nh : nh + nkv], ly.k_norm), cos, sin)
            v = qkv[:, nh + nkv :]
            attn = backend.forward(i, q, k, v.contiguous(), meta, scale=hd**-0.5)
            h.add_(self.linear(attn.reshape(t, nh * hd), ly.w_o, ly.b_o))
            gate, up = self.linear(self._rms(h, ly.ln_post), ly.w_gate_up).chunk(2, dim=-1)
            h.add_(self.linear(self.act(gate).mul_(up), ly.w_down))
        return self._rms(h, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.lm_head)

    def compute_logits_for(self, hidden: torch.Tensor, subset: VocabSubset) -> torch.Tensor:
        # The subset's rows of the output head, gathered (and packed) once per subset.
        head = self._subset_heads.get(subset.ids)
        if head is None:
            if len(self._subset_heads) >= 8:
                self._subset_heads.pop(next(iter(self._subset_heads)))
            weight = self.model.get_output_embeddings().weight
            index = subset.index.to(weight.device)
            head = self._pack(weight[index].contiguous())
            if isinstance(self.lm_head, BlockWeight):  # the same rows' blocks: same numbers as the full head
                head = self.lm_head.rows(index, head)
            self._subset_heads[subset.ids] = head
        return self.linear(hidden, head)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` with ``sin_signed`` as built in forward."""
    rot = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed)
    return (x * cos).add_(rot)


def _same(w: torch.Tensor) -> torch.Tensor:
    return w
