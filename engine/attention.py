"""Paged attention: the backend interface, its metadata, and a portable PyTorch backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One step's layout, shared by every layer. Tokens are flat: sequence ``i`` owns query rows
    ``query_start[i]:query_start[i+1]`` and attends to its first ``seq_lens[i]`` positions."""

    slot_mapping: torch.Tensor  # [T] cache slot written by each new token
    query_start: list[int]  # [B + 1]
    seq_lens: list[int]  # [B] context length after this step
    block_tables: list[list[int]]  # [B][blocks]
    block_size: int
    # Per-sequence encoder output for cross-attention layers (None where a sequence has none).
    encoder_outputs: list[torch.Tensor | None] = field(default_factory=list)
    backend_state: object = None  # whatever the backend's prepare() precomputed

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(ABC):
    """Contract: ``forward`` first writes the new tokens' keys/values into the paged cache at
    ``meta.slot_mapping``, then returns, for every query row, attention over its own sequence's
    cached positions ``0 .. seq_len-1``, causal (a query at position p sees keys at <= p, and
    > p - sliding_window when a window is given). Backends own the cache tensors."""

    name: str = "abstract"

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step indices once for all layers (stored in ``meta.backend_state``)."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] for the new tokens. Returns [T, H, D]."""

    @abstractmethod
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of forked sequences)."""


@dataclass
class _GatherPlan:
    slots: torch.Tensor  # [Bd, Lmax] cache slots of each decode sequence, padded
    pos: torch.Tensor  # [Bd] position of each decode query
    mask: torch.Tensor  # [Bd, Lmax] valid keys


@dataclass
class _TorchState:
    prefills: list[tuple[int, int, int, torch.Tensor | None]]  # (q_start, q_end, seq_len, slots or None)
    decode_rows: torch.Tensor | slice | None = None  # query rows of single-token sequences
    decode: Any = None  # what _prepare_decode built for them


class TorchPagedAttention(AttentionBackend):
    """Portable backend: gathers each sequence's KV from the paged cache with ``index_select``
    and runs ``scaled_dot_product_attention``. Single-token (decode) queries are batched into one
    padded call; multi-token (prefill) chunks run one call each, reading fresh K/V directly when
    the chunk starts at position 0."""

    name = "torch"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def _slots(self, table: list[int], length: int) -> torch.Tensor:
        blocks = torch.tensor(table, dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        return slots[:length]

    def prepare(self, meta: AttentionMetadata) -> None:
        decode_idx, prefills = [], []
        for i in range(meta.num_seqs):
            qs, qe, n = meta.query_start[i], meta.query_start[i + 1], meta.seq_lens[i]
            if qe - qs == 1:
                decode_idx.append(i)
            else:
                fresh = qe - qs == n  # no cached context: attend to this chunk's own K/V
                prefills.append((qs, qe, n, None if fresh else self._slots(meta.block_tables[i], n).to(self.device)))
        state = _TorchState(prefills)
        if decode_idx:
            rows = [meta.query_start[i] for i in decode_idx]
            # The runner lays decodes out first: a slice avoids a gather/scatter per layer.
            contiguous = rows == list(range(len(rows)))
            state.decode_rows = slice(0, len(rows)) if contiguous else torch.tensor(rows, device=self.device)
            state.decode = self._prepare_decode(
                [meta.seq_lens[i] for i in decode_idx], [meta.block_tables[i] for i in decode_idx]
            )
        meta.backend_state = state

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if softcap is not None:
            raise NotImplementedError(f"the {self.name} paged backend does not implement attention logit soft-capping")
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kc.index_copy_(0, meta.slot_mapping, k)
        vc.index_copy_(0, meta.slot_mapping, v)
        state: _TorchState = meta.backend_state  # type: ignore[assignment]
        out = torch.empty_like(q)
        if state.decode_rows is not None:
            out[state.decode_rows] = self._decode(q[state.decode_rows], kc, vc, state.decode, scale, sliding_window)
        for qs, qe, n, slots in state.prefills:
            if slots is None:
                keys, values = k[qs:qe], v[qs:qe]
            else:
                keys, values = kc.index_select(0, slots), vc.index_select(0, slots)
            out[qs:qe] = self._prefill(q[qs:qe], keys, values, n, scale, sliding_window)
        return out

    def _prepare_decode(self, lens: list[int], tables: list[list[int]]) -> Any:
        lmax = max(lens)
        # One tensor op for the batch, not a few per sequence (the step's cost on a GPU). Slots past
        # a sequence's length (block 0 where its table is short) are masked out below.
        width = -(-lmax // self.block_size)
        padded = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], dtype=torch.long)
        slots = (padded[:, :, None] * self.block_size + torch.arange(self.block_size)).flatten(1)[:, :lmax]
        lens_t = torch.tensor(lens)
        mask = torch.arange(lmax)[None, :] < lens_t[:, None]
        return _GatherPlan(slots.to(self.device), (lens_t - 1).to(self.device), mask.to(self.device))

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: Any, scale: float, window: int | None
    ) -> torch.Tensor:
        """q: [Bd, H, D] (one query per sequence) → [Bd, H, D]."""
        bd, lmax = plan.slots.shape
        flat = plan.slots.flatten()
        keys = kc.index_select(0, flat).view(bd, lmax, *kc.shape[1:]).transpose(1, 2)
        values = vc.index_select(0, flat).view(bd, lmax, *vc.shape[1:]).transpose(1, 2)
        mask = plan.mask
        if window is not None:
            mask = mask & (torch.arange(lmax, device=q.device)[None, :] > (plan.pos[:, None] - window))
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int, scale: float, window: int | None
    ) -> torch.Tensor:
        n = q.shape[0]
        query, keys, values = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if n == seq_len and window is None:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask = mask & (k_pos > q_pos - window)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in copies]).to(self.device)
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in copies]).to(self.device)
        for cache in (*self.k_cache, *self.v_cache):
            cache.index_copy_(0, dst, cache.index_select(0, src))


class NativeCPUPagedAttention(TorchPagedAttention):
    """CPU backend: decode attention by a C kernel that reads K/V in place from the paged cache
    (see ``engine/csrc/paged_decode.c``); prefill chunks by an AVX-512 causal flash-attention
    kernel (``engine/csrc/prefill_attn.c``, 2-3.5x SDPA here) where it can run, else as in the
    PyTorch backend."""

    name = "native"

    @staticmethod
    def available(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
        from engine.native import paged_decode_kernel

        return (
            torch.device(device).type == "cpu"
            and dtype == torch.float32
            and head_dim % 16 == 0
            and (paged_decode_kernel() is not None)
        )

    def _prepare_decode(self, lens: list[int], tables: list[list[int]]) -> Any:
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        return padded, torch.tensor(lens, dtype=torch.long)

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: Any, scale: float, window: int | None
    ) -> torch.Tensor:
        from engine.native import paged_decode

        tables, lens = plan
        return paged_decode(q.contiguous(), kc, vc, tables, lens, self.block_size, scale, window)

    @staticmethod
    def _prefill(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int, scale: float, window: int | None
    ) -> torch.Tensor:
        from engine.native import prefill_attn, prefill_attn_kernel

        n, d = q.shape[0], q.shape[-1]
        # A few rows over a long context (n < 12 and L > 64 n) fill too little of the kernel's
        # 32-row blocks and heads-only tasks: SDPA is as fast or faster there (bench attention).
        few_rows = n < 12 and seq_len > 64 * n
        fits = window is None and q.dtype == torch.float32 and d % 16 == 0 and d <= 256 and not few_rows
        if not fits or prefill_attn_kernel() is None:
            return TorchPagedAttention._prefill(q, keys, values, seq_len, scale, window)
        # The kernel takes any row stride but needs each row's [heads, D] contiguous.
        q, keys, values = (t if t.stride()[1:] == (d, 1) else t.contiguous() for t in (q, keys, values))
        return prefill_attn(q, keys, values, seq_len, scale)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchPagedAttention,
    "native": NativeCPUPagedAttention,
}


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> type[AttentionBackend]:
    """``auto``: the native CPU kernel where it can run, else the portable PyTorch backend."""
    if name == "auto":
        return (
            NativeCPUPagedAttention
            if NativeCPUPagedAttention.available(device, dtype, head_dim)
            else TorchPagedAttention
        )
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(ATTENTION_BACKENDS)}")
    if name == "native" and not NativeCPUPagedAttention.available(device, dtype, head_dim):
        raise ValueError(
            "the native attention backend needs an x86 CPU with AVX2/FMA, fp32, a C compiler and head_dim % 16 == 0"
        )
    return ATTENTION_BACKENDS[name]
