"""Run one diffusion request across N processes (ranks) with context parallelism.

:class:`ContextParallelRunner` starts ``degree`` rank processes on loopback (gloo on CPU, NCCL when
each rank can have its own GPU). Every rank loads the same pipeline directory with
:class:`~modalities.diffusion.model.DiffusionModel` and installs the CP hooks on its denoiser. Rank 0
takes requests from the parent through a queue and broadcasts them; all ranks run the same denoising
loop (same seeds, so the same initial noise; gathered model outputs are identical copies, so the
scheduler states never diverge) and rank 0 returns the decoded output. The parent process never joins
the process group, so a wedged collective cannot take the server down with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from modalities.diffusion.parallel.comm import ContextParallelConfig

logger = logging.getLogger(__name__)
_POLL_S = 0.2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def forward_shape_for(model: Any, shape: Any, batch: int) -> Any:
    """The CP forward shape of ``model``'s denoiser for a request ``shape`` (no compute)."""
    from modalities.diffusion.parallel.volume import dit_forward_shape

    pipe = model.pipe
    vae = int(getattr(pipe, "vae_scale_factor_spatial", 0) or getattr(pipe, "vae_scale_factor", 8))
    frames = (shape.num_frames - 1) // model.frame_step + 1 if model.is_video else 1
    return dit_forward_shape(
        model.denoiser, latent_hw=(shape.height // vae, shape.width // vae), latent_frames=frames, batch=batch
    )


# What a rank imports before it loads a pipeline: ~8 s on 2 cores, most of a 2-rank start. Only
# installed packages: the fork server finds modules on its own path, not the server's, so it could
# import another checkout's ``modalities``.
RANK_PRELOAD = ["diffusers.pipelines.pipeline_utils"]


def rank_context(backend: str = "gloo") -> Any:
    """The multiprocessing context ranks start in. CPU (gloo) ranks fork from a fork server that
    imported ``RANK_PRELOAD`` once per server process, where spawned ranks each import it again;
    only the fork server's first start sets its preload, and it forks with the environment it
    started with (``_rank_main`` applies the server's). NCCL ranks are spawned: an import in the
    fork server that initialised CUDA (e.g. xformers, which diffusers imports when installed)
    would fail every forked rank's CUDA."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def _next_request(requests: Any, parent: Any) -> Any:
    """Rank 0's next request; ``None`` (shut down) once ``parent``, the server process that started
    the ranks, is gone, so ranks never outlive a killed server. (Their parent in the OS is the fork
    server, which lives on while they do.)"""
    while True:
        try:
            return requests.get(timeout=1.0)
        except queue.Empty:
            if not parent.is_alive():
                return None


def _rank_main(
    rank: int,
    cfg: ContextParallelConfig,
    port: int,
    path: str,
    threads: int,
    backend: str,
    requests: Any,
    results: Any,
    cancel: Any,
    env: dict[str, str],
) -> None:
    """One rank: load, hook, then serve broadcast requests until a ``None`` request. Its ``ready``
    message says whether it started with ``RANK_PRELOAD`` imported."""
    preloaded = all(name in sys.modules for name in RANK_PRELOAD)
    os.environ.clear()
    os.environ.update(env)  # (the server's now, not the fork server's when it started)
    import torch.distributed as dist

    from modalities.diffusion.model import DiffusionModel, StopGeneration
    from modalities.diffusion.parallel.comm import CPGroups
    from modalities.diffusion.parallel.hooks import apply_context_parallel
    from modalities.diffusion.parallel.volume import bytes_per_forward, check_divisible

    parent = mp.parent_process()
    torch.set_num_threads(threads)
    world = cfg.world_size
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=5)
        )
        groups = CPGroups(cfg)
        model = DiffusionModel(path)
        model.cache.reduce = groups.all_reduce_sum  # first-block cache decisions agree on every rank
        if backend == "nccl":
            torch.cuda.set_device(rank)
            model.pipe.to(f"cuda:{rank}")
        handle = apply_context_parallel(model.denoiser, groups)
    except Exception:
        results.put(("fatal", rank, traceback.format_exc()))
        return
    results.put(("ready", rank, preloaded))
    flag = torch.zeros(1, dtype=torch.int32, device=f"cuda:{rank}" if backend == "nccl" else "cpu")
    while True:
        box = [_next_request(requests, parent) if rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception:  # rank 0 is gone (its parent died): nothing left to serve
            os._exit(1)
        if box[0] is None:
            break
        shape, items, want_steps = box[0]

        def on_step(i: int, latents: torch.Tensor, want_steps: bool = want_steps) -> None:
            # Every rank takes part in this broadcast each step, so a cancel stops all of them at
            # the same step (rank 0 alone raising would leave the others blocked in a collective).
            flag.fill_(int(rank == 0 and cancel.is_set()))
            dist.broadcast(flag, src=0)
            if rank == 0 and want_steps:
                results.put(("step", i, latents.detach().cpu().numpy()))
            if int(flag.item()):
                raise StopGeneration

        try:
            check_divisible(cfg, forward_shape_for(model, shape, len(items)))
            groups.counter.reset()
            handle.reset_forwards()
            blocks = (model.counter.calls, model.counter.run)
            out = model.generate(shape, items, on_step=on_step)
        except StopGeneration:
            if rank == 0:
                results.put(("stopped", None, None))
            continue
        except ValueError as exc:  # deterministic, raised by every rank before any collective
            if rank == 0:
                results.put(("invalid", None, str(exc)))
            continue
        except Exception:
            results.put(("fatal", rank, traceback.format_exc()))
            break
        if rank == 0:
            expected: dict[str, int] = {}
            for b, layers in zip(handle.forward_batches, handle.forward_layers, strict=True):
                fwd = dataclasses.replace(forward_shape_for(model, shape, b), layers=layers)
                for k, v in bytes_per_forward(cfg, fwd).items():
                    expected[k] = expected.get(k, 0) + v
            if groups.counter.calls["reduce"]:  # the cache's decisions: [change, scale] per request
                per_call = 2 * (2 * len(items) * 4) * (world - 1) // world
                expected["reduce"] = groups.counter.calls["reduce"] * per_call
            stats = {
                "steps": shape.steps,
                "forwards": len(handle.forward_batches),
                "measured": dict(groups.counter.bytes),
                "expected": expected,
                "blocks_called": model.counter.calls - blocks[0],
                "blocks_run": model.counter.run - blocks[1],
            }
            results.put(("done", out, stats))
    dist.destroy_process_group()


class ContextParallelRunner:
    """``degree`` ranks running one pipeline directory; :meth:`generate` mirrors
    :meth:`DiffusionModel.generate <modalities.diffusion.model.DiffusionModel.generate>`.

    ``mode`` is ``ulysses``, ``ring`` or ``hybrid`` (see :meth:`ContextParallelConfig.for_degree`).
    Thread-safe (one request at a time). A size that cannot be sharded (tokens not divisible by the
    degree, heads not by the Ulysses degree) raises ``ValueError`` before any compute. First-block
    caching works: its skip decision is all-reduced, so every rank skips the same steps as one
    process would; a crashed rank raises ``RuntimeError`` and the ranks restart on the next call.
    """

    def __init__(
        self,
        path: str | Path,
        degree: int = 2,
        mode: str = "ulysses",
        *,
        threads_per_rank: int | None = None,
        backend: str | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.path = str(path)
        self.config = ContextParallelConfig.for_degree(degree, mode)
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= degree
        self.backend = backend or ("nccl" if use_cuda else "gloo")
        self.threads = threads_per_rank or max(1, (os.cpu_count() or 1) // degree)
        self.start_timeout_s = start_timeout_s
        self.last_stats: dict[str, Any] = {}
        self.preloaded = False  # the ranks started with RANK_PRELOAD imported (``_rank_main``)
        self._procs: list[Any] = []
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks and wait until every one has loaded the pipeline (idempotent)."""
        if self._procs:
            return
        ctx = rank_context(self.backend)
        self._requests, self._results, self._cancel = ctx.Queue(), ctx.Queue(), ctx.Event()
        port = _free_port()
        args = (
            self.config,
            port,
            self.path,
            self.threads,
            self.backend,
            self._requests,
            self._results,
            self._cancel,
            dict(os.environ),
        )
        self._procs = [
            ctx.Process(target=_rank_main, args=(r, *args), daemon=True) for r in range(self.config.world_size)
        ]
        for p in self._procs:
            p.start()
        ready: dict[int, bool] = {}
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < len(self._procs):
            kind, rank, payload = self._next(deadline)
            if kind != "ready":
                self.close()
                raise RuntimeError(f"context-parallel rank {rank} failed to start:\n{payload}")
            ready[rank] = payload
        self.preloaded = all(ready.values())
        if self.backend != "nccl" and not self.preloaded:
            logger.warning("context-parallel ranks started without their preload (a fork server started elsewhere)")

    def close(self) -> None:
        """Stop the ranks (a clean shutdown if they are idle, otherwise terminate)."""
        procs, self._procs = self._procs, []
        if not procs:
            return
        if all(p.is_alive() for p in procs):
            self._requests.put(None)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    def _next(self, deadline: float | None = None) -> tuple[str, Any, Any]:
        while True:
            try:
                return self._results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.close()
                    raise RuntimeError(f"context-parallel rank(s) {dead} exited") from None
                if deadline is not None and time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError("context-parallel ranks did not answer in time") from None

    # -- requests --------------------------------------------------------------------------------

    def generate(
        self, shape: Any, items: Sequence[Any], on_step: Callable[[int, torch.Tensor], None] | None = None
    ) -> np.ndarray:
        """Run one batch across the ranks; same contract as ``DiffusionModel.generate`` (float32 in
        [0, 1]; ``on_step(i, latents)`` after each step, in this process, may raise ``StopGeneration``,
        which stops every rank at the next step boundary). Sets :attr:`last_stats`."""
        from modalities.diffusion.model import StopGeneration

        with self._lock:
            self.start()
            self._cancel.clear()
            self._requests.put((shape, list(items), on_step is not None))
            callback_error: BaseException | None = None
            while True:
                kind, a, b = self._next()
                if kind == "step":
                    if on_step is not None and callback_error is None:
                        try:
                            on_step(a, torch.from_numpy(b))
                        except BaseException as exc:  # stop the ranks, re-raise once they are idle again
                            callback_error = exc
                            self._cancel.set()
                    continue
                if kind == "done":
                    self.last_stats = _per_step(b)
                    if callback_error is not None:
                        raise callback_error
                    return a
                if kind == "stopped":
                    raise callback_error or StopGeneration()
                if kind == "invalid":
                    raise ValueError(b)
                self.close()
                raise RuntimeError(f"context-parallel rank {a} failed:\n{b}")


def _per_step(stats: dict[str, Any]) -> dict[str, Any]:
    steps = max(1, int(stats["steps"]))
    measured, expected = stats["measured"], stats["expected"]
    return {
        **stats,
        "bytes_per_step": sum(measured.values()) / steps,
        "expected_bytes_per_step": sum(expected.values()) / steps,
    }
