"""Paged attention backends agree with dense causal attention over each sequence's own tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import (
    ATTENTION_BACKENDS,
    AttentionMetadata,
    NativeCPUPagedAttention,
    TorchPagedAttention,
    select_backend,
)
from engine.native import prefill_attn, prefill_attn_kernel

BS = 4


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Reference for one whole sequence: q [n, H, D], k/v [n, Hkv, D]."""
    n = q.shape[0]
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


def _backends(head_dim: int) -> list[str]:
    names = ["torch"]
    if NativeCPUPagedAttention.available("cpu", torch.float32, head_dim):
        names.append("native")
    return names


@pytest.mark.parametrize("head_dim", [32, 80])
@pytest.mark.parametrize("window", [None, 5])
def test_backends_match_dense_reference(head_dim: int, window: int | None) -> None:
    heads, kv_heads, num_blocks = 6, 2, 64
    gen = torch.Generator().manual_seed(head_dim)
    lengths = [9, 1, 14, 6]  # full sequences, computed in two steps: a prefill chunk, then decodes
    qs = [torch.randn(n, heads, head_dim, generator=gen) for n in lengths]
    ks = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
    vs = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
    expected = [_dense(q, k, v, window) for q, k, v in zip(qs, ks, vs, strict=True)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[i * 4 : i * 4 + 4] for i in range(len(lengths))]  # scattered blocks

    for name in _backends(head_dim):
        backend = ATTENTION_BACKENDS[name](1, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu")
        got = [[] for _ in lengths]
        # Step 1: the first n-2 tokens (or all, if short) as a prefill chunk; then one token per step.
        done = [max(1, n - 2) for n in lengths]
        steps = [[(0, d)] + [(p, p + 1) for p in range(d, n)] for d, n in zip(done, lengths, strict=True)]
        for step in range(max(len(s) for s in steps)):
            items = [(i, s[step]) for i, s in enumerate(steps) if step < len(s)]
            items.sort(key=lambda it: it[1][1] - it[1][0] > 1)  # decodes first, as the runner lays them out
            slots, query_start = [], [0]
            for i, (a, b) in items:
                slots += [tables[i][p // BS] * BS + p % BS for p in range(a, b)]
                query_start.append(query_start[-1] + b - a)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots),
                query_start=query_start,
                seq_lens=[b for _, (a, b) in items],
                block_tables=[tables[i] for i, _ in items],
                block_size=BS,
            )
            backend.prepare(meta)
            out = backend.forward(
                0,
                torch.cat([qs[i][a:b] for i, (a, b) in items]),
                torch.cat([ks[i][a:b] for i, (a, b) in items]),
                torch.cat([vs[i][a:b] for i, (a, b) in items]),
                meta,
                scale=head_dim**-0.5,
                sliding_window=window,
            )
            for j, (i, _) in enumerate(items):
                got[i].append(out[query_start[j] : query_start[j + 1]])
        for i in range(len(lengths)):
            torch.testing.assert_close(torch.cat(got[i]), expected[i], atol=1e-5, rtol=1e-5, msg=name)


def test_select_backend() -> None:
    assert select_backend("torch", "cpu", torch.float32, 64).name == "torch"
    assert select_backend("auto", "cpu", torch.bfloat16, 64).name == "torch"  # the C kernel is fp32-only
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash9", "cpu", torch.float32, 64)


@pytest.mark.skipif(not NativeCPUPagedAttention.available("cpu", torch.float32, 64), reason="no native kernel here")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 700])
def test_native_decode_long_contexts(threads: int, window: int | None) -> None:
    """Contexts past one 512-row chunk and batches smaller than the thread count: the kernel
    splits sequences into chunks and merges their softmax states; the result must not change."""
    from engine.native import paged_decode

    heads, kv_heads, d, bs = 9, 3, 64, 16
    lengths = [1300, 1, 513, 40]
    gen = torch.Generator().manual_seed(1)
    blocks = [(n + bs - 1) // bs for n in lengths]
    perm = torch.randperm(sum(blocks) + 5, generator=gen)
    kc = torch.randn(len(perm) * bs, kv_heads, d, generator=gen)
    vc = torch.randn(len(perm) * bs, kv_heads, d, generator=gen)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch in (lengths, lengths[:1], lengths[2:3]):  # batch of 4, and single long sequences
            offs = [sum(blocks[: lengths.index(n)]) for n in batch]
            tables = torch.zeros(len(batch), max(blocks), dtype=torch.long)
            for i, (n, o) in enumerate(zip(batch, offs, strict=True)):
                nb = (n + bs - 1) // bs
                tables[i, :nb] = perm[o : o + nb]
            q = torch.randn(len(batch), heads, d, generator=gen)
            got = paged_decode(q, kc, vc, tables, torch.tensor(batch), bs, d**-0.5, window)
            for i, n in enumerate(batch):
                slots = (tables[i, :, None] * bs + torch.arange(bs)).flatten()[:n]
                lo = n - window if window is not None and n > window else 0
                k, v = kc[slots[lo:]], vc[slots[lo:]]
                ref = _dense(torch.cat([torch.zeros(n - lo - 1, heads, d), q[i : i + 1]]), k, v, None)[-1]
                torch.testing.assert_close(got[i], ref, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(prefill_attn_kernel() is None, reason="no native prefill kernel here (needs AVX-512F)")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 128), (6, 2, 32)])
@pytest.mark.parametrize(
    ("n", "length"), [(2, 2), (37, 37), (64, 64), (300, 300), (5, 40), (100, 357), (1, 9), (3, 500)]
)
def test_native_prefill_matches_sdpa(threads: int, heads: int, kv_heads: int, d: int, n: int, length: int) -> None:
    """The C prefill kernel equals SDPA: whole chunks and chunks over cached context, row counts
    off its 16-row groups, GQA groups 1 and 3, strided key/value rows."""
    gen = torch.Generator().manual_seed(n * length + d)
    q = torch.randn(n, heads, d, generator=gen)
    # Keys/values as the forward slices them out of a fused [T, Hkv * 2, D] tensor: strided rows.
    kv = torch.randn(length, 2 * kv_heads, d, generator=gen)
    keys, values = kv[:, :kv_heads], kv[:, kv_heads:]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = prefill_attn(q, keys, values, length, d**-0.5)
    finally:
        torch.set_num_threads(old)
    expected = TorchPagedAttention._prefill(q, keys, values, length, d**-0.5, None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
