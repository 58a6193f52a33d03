"""Prefill attention kernel vs SDPA: ``mmserve bench attention``.

Times the native C causal prefill kernel (``engine/csrc/prefill_attn.c``) against the PyTorch
path it replaces (``TorchPagedAttention._prefill``: SDPA, causal, GQA) on random fp32 inputs,
one sequence's chunk of n query rows over L positions, and reports the max abs difference.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

# (n, L): whole prefills, a chunk over cached context, and few rows over long contexts (where
# NativeCPUPagedAttention keeps SDPA: n < 12 and L > 64 n).
CASES = ((64, 64), (128, 128), (256, 256), (512, 512), (1024, 1024), (2048, 2048), (300, 900))
CASES += ((4, 300), (8, 2000), (16, 2000))


def _best_ms(fn: Callable[[], object], budget_s: float) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmserve bench attention", description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="timing budget per case and path")
    args = ap.parse_args(argv)

    from engine.attention import TorchPagedAttention
    from engine.native import prefill_attn, prefill_attn_kernel

    if prefill_attn_kernel() is None:
        print("the native prefill kernel cannot run here (needs AVX-512F, a C compiler, no MMSERVE_NO_NATIVE)")
        return 1
    torch.set_num_threads(args.threads)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    print(f"H={h} Hkv={hkv} D={d} fp32, {args.threads} threads; GFLOP/s counts the causal half (4*n*L_avg*H*D)")
    print(f"{'n':>5} {'L':>5} {'sdpa ms':>9} {'native ms':>9} {'speedup':>7} {'native GFLOP/s':>14} {'max |diff|':>10}")
    gen = torch.Generator().manual_seed(0)
    for n, length in CASES:
        q = torch.randn(n, h, d, generator=gen)
        k, v = torch.randn(length, hkv, d, generator=gen), torch.randn(length, hkv, d, generator=gen)
        ref = TorchPagedAttention._prefill(q, k, v, length, scale, None)
        diff = (prefill_attn(q, k, v, length, scale) - ref).abs().max().item()
        t_ref = _best_ms(lambda: TorchPagedAttention._prefill(q, k, v, length, scale, None), args.seconds)  # noqa: B023
        t_nat = _best_ms(lambda: prefill_attn(q, k, v, length, scale), args.seconds)  # noqa: B023
        flops = 4 * n * (length - n + (n + 1) / 2) * h * d
        print(
            f"{n:>5} {length:>5} {t_ref:>9.3f} {t_nat:>9.3f} {t_ref / t_nat:>7.2f} {flops / t_nat / 1e6:>14.0f}"
            f" {diff:>10.2e}"
        )
    return 0
