"""A GGUF file's own quantized weights (Q4_1, Q8_0), served in place by a native kernel.

The loader dequantizes a GGUF file to fp32 (``model_loader.convert_gguf``); a memory-bound
decode step then reads 4 bytes per weight where the file had 0.625 (Q4_1) or 1.0625 (Q8_0).
``match_blocks`` finds, for each fp32 weight, the file's blocks that dequantize to exactly that
tensor (under the identity row order or llama.cpp's rotary permutation of q/k rows, which the
loader undid). Every weight served from blocks is thus proven equal to the fp32 one: the two
paths differ only in summation order. A weight with no exact match stays fp32.

``BlockWeight`` keeps both forms: ``blockq_linear`` (the C kernel) for decode steps and short
prefills (up to ``native.blockq_max_rows()`` rows: reading fewer bytes wins there), the dense fp32
weight above that (a long prefill is compute-bound, where oneDNN wins).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

QK = 32  # weights per block
FORMATS = {"Q8_0": 0, "Q4_1": 1}  # name -> the kernel's fmt code
_BLOCK_BYTES = {0: 2 + QK, 1: 4 + QK // 2}  # fp16 d (and m), then the quants


@dataclass
class BlockWeight:
    """A linear's weight [N, K] in 32-weight blocks along K: ``q`` uint8 [N, K/32, 16] (Q4_1:
    two 4-bit quants per byte, GGUF's layout) or [N, K/32, 32] (Q8_0: int8); ``d`` fp32
    [N, K/32]; ``m`` fp32 [N, K/32] (Q4_1 only). w = d * q (+ m). ``dense``: the same weight in
    fp32, in whatever form the adapter's dense linear takes."""

    fmt: int
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    dense: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * QK

    def dequantize(self) -> torch.Tensor:
        if self.fmt == 1:
            qs = torch.cat([self.q & 0x0F, self.q >> 4], dim=-1).float()
            w = self.d[..., None] * qs + self.m[..., None]  # type: ignore[index]
        else:
            w = self.q.view(torch.int8).float() * self.d[..., None]
        return w.reshape(self.shape)

    def rows(self, index: torch.Tensor, dense: torch.Tensor) -> BlockWeight:
        """The weight of output rows ``index`` (``dense``: their fp32 form)."""
        m = None if self.m is None else self.m[index].contiguous()
        return replace(self, q=self.q[index].contiguous(), d=self.d[index].contiguous(), m=m, dense=dense)


def cat_blocks(parts: list[BlockWeight | None], dense: torch.Tensor) -> BlockWeight | torch.Tensor:
    """Weights stacked along N (fused q/k/v, gate/up): blocks if every part has them in one format,
    else just ``dense``."""
    if any(p is None for p in parts) or len({p.fmt for p in parts}) != 1:  # type: ignore[union-attr]
        return dense
    ps: list[BlockWeight] = parts  # type: ignore[assignment]
    if len(ps) == 1:  # nothing to stack: share the blocks instead of copying them
        return replace(ps[0], dense=dense)
    m = None if ps[0].m is None else torch.cat([p.m for p in ps])  # type: ignore[misc]
    return BlockWeight(ps[0].fmt, torch.cat([p.q for p in ps]), torch.cat([p.d for p in ps]), m, dense)


def _parse(raw: np.ndarray, fmt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, _BLOCK_BYTES[fmt])
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    if fmt == 1:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return torch.from_numpy(blocks[..., 4:].copy()), d, m
    return torch.from_numpy(blocks[..., 2:].copy()), d, None


def _rotary_rows(n: int, heads: int) -> torch.Tensor:
    """Row order of llama.cpp's q/k permutation as transformers' GGUF loader undoes it."""
    return torch.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)


def block_tensors(gguf: Path) -> list[tuple[str, int, int, int, int, int]]:
    """(name, fmt, N, K, byte offset, byte count) of each 2-D Q4_1/Q8_0 tensor in ``gguf``.

    ``gguf.GGUFReader`` parses all the metadata first (a tokenizer's ~100k strings: seconds per
    engine start), so the table is kept as JSON in the cache, keyed by the file's path, size and
    modification time; a later start reads the blocks straight from the file at those offsets."""
    from engine.model_loader import cache_root

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    table = cache_root() / "gguf-tables" / f"{gguf.stem}-{key}.json"
    if table.is_file():
        return [tuple(row) for row in json.loads(table.read_text())]
    from gguf import GGUFReader

    rows = []
    for t in GGUFReader(str(gguf)).tensors:
        fmt = FORMATS.get(t.tensor_type.name)
        if fmt is not None and len(t.shape) == 2:
            n, k = int(t.shape[1]), int(t.shape[0])  # GGUF lists dimensions innermost first
            rows.append((t.name, fmt, n, k, int(t.data_offset), int(t.n_bytes)))
    table.parent.mkdir(parents=True, exist_ok=True)
    tmp = table.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: never half a table
    tmp.write_text(json.dumps(rows))
    tmp.replace(table)
    return rows


def match_blocks(gguf: Path, weights: dict[str, torch.Tensor], heads: dict[str, int]) -> dict[str, BlockWeight]:
    """For each named fp32 weight, the GGUF tensor (Q4_1 or Q8_0) that dequantizes to it exactly.
    ``heads``: per weight name, the head count of llama.cpp's q/k row permutation to also try.
    The returned ``BlockWeight.dense`` is the given fp32 tensor."""
    data = np.memmap(gguf, mode="r")
    by_shape: dict[tuple[int, int], list[tuple[str, int, np.ndarray]]] = {}
    for tname, fmt, n, k, offset, size in block_tensors(gguf):
        by_shape.setdefault((n, k), []).append((tname, fmt, data[offset : offset + size].reshape(n, -1)))
    found: dict[str, BlockWeight] = {}
    for name, w in weights.items():
        if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % QK:
            continue
        orders = [None] + ([_rotary_rows(w.shape[0], heads[name])] if name in heads else [])
        for _gname, fmt, raw in by_shape.get((w.shape[0], w.shape[1]), []):
            # Row 0 stays row 0 under the permutation: a cheap test before the whole tensor.
            if not torch.equal(BlockWeight(fmt, *_parse(raw[:1], fmt), w[:1]).dequantize(), w[:1]):
                continue
            q, d, m = _parse(raw, fmt)
            bw = BlockWeight(fmt, q, d, m, w)
            hit = next((o for o in orders if torch.equal(_dequantized_rows(bw, o), w)), False)
            if hit is not False:
                found[name] = bw if hit is None else bw.rows(hit, w)
                break
    missing = sorted(set(weights) - set(found))
    logger.info("%d of %d weights served from %s's own blocks", len(found), len(weights), gguf.name)
    if missing:
        logger.info("%d weights have no exact GGUF blocks and stay fp32: %s", len(missing), missing[:4])
    return found


def model_blocks(model: torch.nn.Module, gguf: Path) -> dict[str, BlockWeight]:
    """``match_blocks`` for a Llama-family transformers model's linears and output head."""
    cfg = model.config
    weights = {n: p for n, p in model.named_parameters() if n.endswith("_proj.weight")}
    weights["lm_head.weight"] = model.get_output_embeddings().weight
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    heads = {n: cfg.num_attention_heads for n in weights if n.endswith("q_proj.weight")}
    heads.update({n: kv_heads for n in weights if n.endswith("k_proj.weight")})
    return match_blocks(gguf, weights, heads)


def _dequantized_rows(bw: BlockWeight, order: torch.Tensor | None) -> torch.Tensor:
    w = bw.dequantize()
    return w if order is None else w[order]
