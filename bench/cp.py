"""``mmserve bench cp``: context parallelism, single process vs N ranks, plus a multi-GPU scaling model.

Measured part (any machine): one tiny (or given) DiT pipeline, single-process ``DiffusionModel`` vs
``ContextParallelRunner`` at each degree/mode: seconds per request, max abs difference of the decoded
pixels against the single-process output at the same seed, and bytes sent per denoising step per rank
(measured by the instrumented collectives, and the analytic value). On a CPU box the ranks share the
same cores, so wall time shows overhead, not scaling.

Model part (no compute): for real model sizes, per-step communication volume from
:mod:`modalities.diffusion.parallel.volume` and an estimate of the step time on N GPUs,
``compute / N + communication / bandwidth`` (Ulysses all-to-alls are on the critical path; ring hops
can hide behind the block attention, so ring uses ``max(compute / N, communication / bandwidth)``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from modalities.diffusion.parallel.comm import ContextParallelConfig
from modalities.diffusion.parallel.volume import ForwardShape, bytes_per_forward


def add_cp_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--arch", default="dit", help="tiny pipeline (dit, video) or a pipeline directory")
    ap.add_argument("--degrees", default="2,4", help="comma-separated CP degrees to run")
    ap.add_argument("--modes", default="ulysses,ring", help="comma-separated: ulysses, ring, hybrid")
    ap.add_argument("--size", type=int, default=32, help="square output side in px")
    ap.add_argument("--frames", type=int, default=5, help="video frames")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="timed requests per configuration (after one warm-up)")
    ap.add_argument("--cache", type=float, default=None, help="first-block cache threshold (default off)")
    ap.add_argument("--model-only", action="store_true", help="print only the analytic scaling model")
    ap.add_argument(
        "--memory", action="store_true", help="only memory: server and rank RSS/USS/PSS before and after the release"
    )
    ap.add_argument("--json", default=None, help="also write the results here")


# -- analytic scaling model ----------------------------------------------------------------------


@dataclass(frozen=True)
class RealConfig:
    name: str
    params: float  # transformer parameters
    shape: ForwardShape  # per forward, bf16
    forwards_per_step: int  # 2 when CFG runs as two forwards


def _real_configs() -> list[RealConfig]:
    # Wan 2.1 14B, 720p x 81 frames: latents 21 x 90 x 160, patch (1, 2, 2) -> 75,600 tokens; 40 blocks,
    # 40 heads x 128; CFG as two forwards. Wan 1.3B, 480p x 81: 21 x 60 x 104 -> 32,760 tokens, 30 x 12 x 128.
    # Flux.1-dev 1024^2: 4,096 image + 512 text tokens (joint), 19 + 38 blocks, 24 x 128, guidance-distilled.
    # PixArt-Sigma 2048^2: latents 256^2, patch 2 -> 16,384 tokens, 28 blocks, 16 x 72, CFG batched.
    return [
        RealConfig("Wan2.1-14B 720p/81f", 14e9, ForwardShape(1, 75_600, 40, 128, 40, 75_600, 64, 2), 2),
        RealConfig("Wan2.1-1.3B 480p/81f", 1.3e9, ForwardShape(1, 32_760, 12, 128, 30, 32_760, 64, 2), 2),
        RealConfig("Flux.1-dev 1024px", 12e9, ForwardShape(1, 4_608, 24, 128, 57, 4_096, 64, 2), 1),
        RealConfig("PixArt-Sigma 2048px", 0.6e9, ForwardShape(2, 16_384, 16, 72, 28, 16_384, 32, 2), 1),
    ]


LINKS = {"NVLink4 ~350 GB/s": 350e9, "PCIe5 ~40 GB/s": 40e9, "PCIe4 ~20 GB/s": 20e9}  # achieved per-GPU send rates
EFFECTIVE_FLOPS = 400e12  # H100 bf16 at ~40% MFU


def step_flops(c: RealConfig) -> tuple[float, float]:
    """(dense, attention) FLOPs of one denoising step on one GPU."""
    s = c.shape
    dense = 2 * c.params * s.batch * s.tokens
    attention = 4 * s.batch * s.tokens**2 * s.heads * s.head_dim * s.layers
    return c.forwards_per_step * dense, c.forwards_per_step * attention


def scaling_model(degrees: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    """Per (model, N, link): estimated step time and speed-up for Ulysses and ring. Ulysses:
    ``(dense + attention) / N + comm / bw`` (all-to-alls on the critical path); ring: ``dense / N +
    max(attention / N, comm / bw)`` (each K/V hop overlaps the previous block's attention)."""
    rows = []
    for c in _real_configs():
        dense, attn = (f / EFFECTIVE_FLOPS for f in step_flops(c))
        t1 = dense + attn
        for n in degrees:
            for link, bw in LINKS.items():
                row = dict(model=c.name, n=n, link=link, step_s_1gpu=t1)
                for mode in ("ulysses", "ring"):
                    cfg = ContextParallelConfig.for_degree(n, mode)
                    if c.shape.heads % cfg.ulysses_degree:
                        row[mode] = None  # Ulysses needs heads divisible by N
                        continue
                    comm = c.forwards_per_step * sum(bytes_per_forward(cfg, c.shape).values())
                    tn = t1 / n + comm / bw if mode == "ulysses" else dense / n + max(attn / n, comm / bw)
                    row[mode] = dict(gb_per_step=comm / 1e9, step_s=tn, speedup=t1 / tn)
                rows.append(row)
    return rows


def print_model(rows: list[dict]) -> None:
    print(f"\nExpected multi-GPU scaling (model: {EFFECTIVE_FLOPS / 1e12:.0f} TFLOP/s per GPU, bf16, bytes per rank)")
    print("| model | N | link | 1-GPU s/step | Ulysses GB/step | Ulysses speed-up | ring GB/step | ring speed-up |")
    print("|---|---|---|---|---|---|---|---|")

    def cells(r: dict | None) -> str:
        return "n/a (heads % N) | n/a" if r is None else f"{r['gb_per_step']:.2f} | {r['speedup']:.2f}x"

    for r in rows:
        print(
            f"| {r['model']} | {r['n']} | {r['link']} | {r['step_s_1gpu']:.3f} | {cells(r['ulysses'])} | {cells(r['ring'])} |"
        )


# -- measured part -------------------------------------------------------------------------------


def _timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return (time.perf_counter() - t0) / repeats, out


def run_measured(args: argparse.Namespace) -> list[dict]:
    import os
    from pathlib import Path

    import numpy as np
    import torch

    from modalities.diffusion.cache import OFF, CacheSpec
    from modalities.diffusion.model import DiffusionModel, Item, Shape
    from modalities.diffusion.parallel import ContextParallelRunner
    from modalities.diffusion.tiny import tiny_model_dir

    path = Path(args.arch) if Path(args.arch).is_dir() else tiny_model_dir(args.arch)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    model = DiffusionModel(path)
    frames = args.frames if model.is_video else 1
    cache = OFF if args.cache is None else CacheSpec("fbc", threshold=args.cache)
    shape = Shape(args.size, args.size, frames, args.steps, 4.0, cache)
    items = [Item("a lighthouse at dusk", "", 1234)]
    run0 = model.counter.run
    base_s, ref = _timed(lambda: model.generate(shape, items), args.repeats)
    blocks = (model.counter.run - run0) // (args.repeats + 1)
    rows = [
        dict(degree=1, mode="single", s_per_request=base_s, speedup=1.0, max_abs_diff=0.0, bytes_per_step=0,
             blocks_run=blocks)
    ]  # fmt: skip
    for n in (int(x) for x in args.degrees.split(",")):
        for mode in args.modes.split(","):
            runner = ContextParallelRunner(path, n, mode, threads_per_rank=max(1, cores // n))
            try:
                runner.start()
                secs, out = _timed(lambda runner=runner: runner.generate(shape, items), args.repeats)
            except ValueError as exc:
                print(f"skip N={n} {mode}: {exc}")
                continue
            finally:
                runner.close()
            st = runner.last_stats
            rows.append(
                dict(degree=n, mode=mode, s_per_request=secs, speedup=base_s / secs,
                     max_abs_diff=float(np.abs(np.asarray(out) - ref).max()), bytes_per_step=st["bytes_per_step"],
                     expected_bytes_per_step=st["expected_bytes_per_step"], forwards=st["forwards"],
                     blocks_run=st["blocks_run"])
            )  # fmt: skip
    print(
        f"\n{model.name}: {args.size}x{args.size}"
        + (f"x{frames}f" if model.is_video else "")
        + f", {args.steps} steps, cache {cache.label} ({rows[0]['blocks_run']} blocks run per request in one process),"
    )
    print(f"{cores} CPU cores shared by all ranks (threads per rank = cores / N): no scaling can show here.")
    print(
        "| N | mode | s/request | speed-up | max abs diff (pixels in [0,1]) | bytes/step/rank (measured = analytic) "
        "| blocks run |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        check = "" if r["degree"] == 1 else (" ✓" if r["bytes_per_step"] == r["expected_bytes_per_step"] else " ✗")
        print(
            f"| {r['degree']} | {r['mode']} | {r['s_per_request']:.3f} | {r['speedup']:.2f}x | "
            f"{r['max_abs_diff']:.2e} | {r['bytes_per_step']:,.0f}{check} | {r['blocks_run']} |"
        )
    return rows


def _mem(pid: int) -> dict[str, float]:
    import psutil

    info = psutil.Process(pid).memory_full_info()
    return {k: getattr(info, k) / 2**20 for k in ("rss", "uss", "pss")}


def run_memory(args: argparse.Namespace) -> list[dict]:
    """What ``--cp-degree N`` holds: the serving process (its ``DiffusionModel``) and the N ranks,
    before and after ``release_generation_weights`` (the serving process's copy of the denoiser and
    text encoders). MiB; USS is memory private to a process, PSS splits shared pages among sharers."""
    import gc
    import os
    from pathlib import Path

    from modalities.diffusion.cache import OFF
    from modalities.diffusion.model import DiffusionModel, Item, Shape
    from modalities.diffusion.parallel import ContextParallelRunner
    from modalities.diffusion.parallel.serving import release_generation_weights
    from modalities.diffusion.tiny import tiny_model_dir

    path = Path(args.arch) if Path(args.arch).is_dir() else tiny_model_dir(args.arch)
    rows = []
    for n in (int(x) for x in args.degrees.split(",")):
        model = DiffusionModel(path)
        runner = ContextParallelRunner(path, n, args.modes.split(",")[0], threads_per_rank=1)
        frames = args.frames if model.is_video else 1
        runner.start()
        try:  # one request first: weights mapped from safetensors are only resident once read
            runner.generate(Shape(args.size, args.size, frames, 2, 4.0, OFF), [Item("a lighthouse", "", 1)])
            ranks = [p.pid for p in runner._procs]
            before = _mem(os.getpid())
            freed = release_generation_weights(model)
            gc.collect()
            after = _mem(os.getpid())
            rank_mem = [_mem(pid) for pid in ranks]
        finally:
            runner.close()
        total = {k: sum(m[k] for m in rank_mem) for k in ("rss", "uss", "pss")}
        rows.append(dict(degree=n, freed_mib=freed / 2**20, server_before=before, server_after=after, ranks=total))
        del model
        gc.collect()
    print(f"\n{path.name}: memory of --cp-degree N (MiB; USS private, PSS shared pages split)")
    print("| N | weights released by the server | server RSS / USS before | after | N ranks RSS / USS / PSS |")
    print("|---|---|---|---|---|")
    for r in rows:
        b, a, k = r["server_before"], r["server_after"], r["ranks"]
        print(
            f"| {r['degree']} | {r['freed_mib']:.1f} | {b['rss']:.0f} / {b['uss']:.0f} | {a['rss']:.0f} / "
            f"{a['uss']:.0f} | {k['rss']:.0f} / {k['uss']:.0f} / {k['pss']:.0f} |"
        )
    return rows


def run_cp(args: argparse.Namespace) -> None:
    if args.memory:
        rows = run_memory(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": getattr(args, "command_line", ""), "memory": rows}, f, indent=1)
        return
    measured = [] if args.model_only else run_measured(args)
    model_rows = scaling_model()
    print_model(model_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"command": getattr(args, "command_line", ""), "measured": measured, "model": model_rows}, f, indent=1
            )


def main(argv: list[str] | None = None) -> int:
    import shlex

    ap = argparse.ArgumentParser(prog="mmserve bench cp", description=__doc__.split("\n\n")[0])
    add_cp_args(ap)
    args = ap.parse_args(argv)
    args.command_line = "mmserve bench cp " + shlex.join(argv or [])
    run_cp(args)
    return 0
