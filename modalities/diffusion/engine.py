"""``DiffusionEngine``: request-level batching of image/video generations on a background thread.

Each request becomes ``n`` items (one per output, seed ``seed + i``). The engine thread takes the
oldest pending item, waits out a short collection window (``batch_window_s``) from its arrival,
and runs every pending item with the same :class:`~modalities.diffusion.model.Shape` (size,
frames, steps, guidance, cache setting) as one pipeline call, up to ``max_batch_size`` outputs.
Every item has its own ``torch.Generator``, so a batched output equals the output of the same
request run alone (within fp32 noise; see ``tests/test_diffusion.py``), step caching included: both
caches decide per request (see ``cache.py``).

The thread is the engine's own, so a long generation never blocks other modalities' event loop.
Between steps it reports progress to each request's ``on_step`` and stops early when every
request of the batch was cancelled (the awaiting task cancelled, or :meth:`cancel`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.batch_loop import BatchLoop, resolve
from engine.errors import EngineDeadError, InvalidParamError, QueueFullError
from modalities.diffusion.cache import resolve_cache
from modalities.diffusion.model import DiffusionModel, Item, Shape, StopGeneration

logger = logging.getLogger("mmserve.diffusion")

StepCallback = Callable[[int, int, torch.Tensor], None]
"""``on_step(step, total, latents)``: called on the engine thread after each denoising step with this
request's latents ``[n, ...]``; keep it quick. It may call :meth:`DiffusionEngine.preview`."""


class GenerationCancelled(Exception):
    """The request was cancelled before it finished."""


@dataclass
class GenerateRequest:
    """One generation request (plain data). ``None`` fields take the model's or server's default;
    ``cache`` is ``"off"``, a preset (``light``/``medium``/``aggressive``) or a first-block threshold;
    ``cache_interval`` sets DeepCache's full-step interval (UNets)."""

    prompt: str
    negative_prompt: str = ""
    n: int = 1
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    cache: str | float | None = None
    cache_interval: int | None = None
    request_id: str | None = None


@dataclass
class GenerateResult:
    """``outputs``: float32 in [0, 1], ``[n, H, W, 3]`` (images) or ``[n, F, H, W, 3]`` (videos)."""

    outputs: np.ndarray
    seeds: list[int]
    width: int
    height: int
    num_frames: int
    steps: int
    guidance_scale: float
    cache: str
    is_video: bool
    elapsed_s: float
    batch_sizes: list[int] = field(default_factory=list)


@dataclass(eq=False)
class _Request:
    seq: int
    request_id: str
    shape: Shape
    seeds: list[int]
    out: np.ndarray | None
    future: asyncio.Future[np.ndarray]
    loop: asyncio.AbstractEventLoop
    on_step: StepCallback | None
    remaining: int
    arrived: float
    batch_sizes: list[int] = field(default_factory=list)
    cancelled: bool = False


@dataclass(eq=False)
class _Item:
    request: _Request
    index: int
    item: Item
    arrived: float


class DiffusionEngine(BatchLoop):
    """Serves one diffusers pipeline. Limits are checked in :meth:`prepare` before any compute."""

    _engine_label = "diffusion"

    def __init__(
        self,
        model: DiffusionModel,
        *,
        served_name: str | None = None,
        default_cache: str | float | None = None,
        max_batch_size: int = 8,
        batch_window_s: float = 0.05,
        max_n: int = 10,
        max_steps: int = 100,
        max_pending: int = 256,
    ) -> None:
        self.model = model
        self.model_name = served_name or model.name
        self.is_video = model.is_video
        self.modality = "video" if model.is_video else "image"  # what the routes and job kinds look for
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.max_n = max_n
        self.max_steps = max_steps
        self.max_pending = max_pending
        self.default_cache = resolve_cache(default_cache, unet=model.is_unet)
        self.default_steps, self.default_guidance = _call_defaults(model)
        self._pending: list[_Item] = []
        self._requests: dict[str, _Request] = {}
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats = {"num_batches": 0, "num_outputs": 0, "num_requests": 0, "num_cancelled": 0, "busy_s": 0.0}

    @classmethod
    def from_path(
        cls, path: str, *, max_side: int = 1024, max_frames: int = 129, weights: bool = True, **kwargs: Any
    ) -> DiffusionEngine:
        """``weights=False``: an engine that only validates (``prepare``), see ``DiffusionModel``."""
        return cls(DiffusionModel(path, max_side=max_side, max_frames=max_frames, weights=weights), **kwargs)

    # -- lifecycle -------------------------------------------------------------------------------

    def start_sync(self) -> None:
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(
                target=self._serve_batches, name=f"diffusion-{self.model_name}", daemon=True
            )
            self._thread.start()

    async def start(self) -> None:
        self.start_sync()

    async def shutdown(self) -> None:
        """Stop after the running batch; requests still pending fail with ``EngineDeadError``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 300)
        self._fail_pending(EngineDeadError("the diffusion engine was shut down"))

    def stats(self) -> dict[str, float]:
        with self._cond:
            counter = self.model.counter
            return {
                **self._stats,
                "num_pending": len(self._pending),
                "blocks_called": counter.calls,
                "blocks_skipped": counter.skipped,
            }

    # -- front -----------------------------------------------------------------------------------

    def prepare(self, req: GenerateRequest) -> tuple[Shape, list[int]]:
        """Validate ``req`` against the model and limits (``ValueError`` -> 400); return the batch
        shape and the seed of each output."""
        if not req.prompt or not req.prompt.strip():
            raise InvalidParamError("prompt must not be empty", "prompt")
        if not 1 <= req.n <= self.max_n:
            raise InvalidParamError(f"n must be between 1 and {self.max_n}", "n")
        steps = self.default_steps if req.steps is None else req.steps
        if not self.model.min_steps <= steps <= self.max_steps:
            raise InvalidParamError(f"steps must be between {self.model.min_steps} and {self.max_steps}", "steps")
        guidance = self.default_guidance if req.guidance_scale is None else float(req.guidance_scale)
        if not 0 <= guidance <= 100:
            raise InvalidParamError("guidance_scale must be between 0 and 100", "guidance_scale")
        width = self.model.default_side if req.width is None else req.width  # (0 is a size, refused)
        height = self.model.default_side if req.height is None else req.height
        frames = self.model.check_shape(width, height, req.num_frames)
        if req.cache is None and req.cache_interval is None:
            cache = self.default_cache
        else:
            cache = resolve_cache(req.cache, unet=self.model.is_unet, interval=req.cache_interval)
        seed = secrets.randbits(31) if req.seed is None else int(req.seed)
        if not 0 <= seed < 2**63 - self.max_n:
            raise InvalidParamError("seed must be a non-negative 63-bit integer", "seed")
        return Shape(width, height, frames, steps, guidance, cache), [seed + i for i in range(req.n)]

    async def run(self, req: GenerateRequest, on_step: StepCallback | None = None) -> GenerateResult:
        """Generate ``req.n`` outputs, batched with concurrent requests of the same shape."""
        shape, seeds = self.prepare(req)
        if self._dead is not None:
            raise EngineDeadError(f"the diffusion engine died: {self._dead!r}")
        self.start_sync()
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        seq = next(self._seq)
        r = _Request(
            seq, req.request_id or f"gen-{seq}", shape, seeds, None, loop.create_future(), loop, on_step, req.n, now
        )
        items = [_Item(r, i, Item(req.prompt, req.negative_prompt or "", s), now) for i, s in enumerate(seeds)]
        with self._cond:
            if len(self._pending) + len(items) > self.max_pending:
                raise QueueFullError(len(self._pending), 5.0)
            self._pending.extend(items)
            self._requests[r.request_id] = r
            self._stats["num_requests"] += 1
            self._cond.notify()
        start = time.perf_counter()
        try:
            outputs = await r.future
        finally:
            with self._cond:
                r.cancelled = r.cancelled or not r.future.done() or r.future.cancelled()
                self._requests.pop(r.request_id, None)
        return GenerateResult(
            outputs=outputs,
            seeds=seeds,
            width=shape.width,
            height=shape.height,
            num_frames=shape.num_frames,
            steps=shape.steps,
            guidance_scale=shape.guidance_scale,
            cache=shape.cache.label,
            is_video=self.is_video,
            elapsed_s=time.perf_counter() - start,
            batch_sizes=r.batch_sizes,
        )

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request (its ``run`` raises ``GenerationCancelled``); false if unknown."""
        with self._cond:
            r = self._requests.get(request_id)
            if r is None:
                return False
            r.cancelled = True
        resolve(r, GenerationCancelled(f"request {request_id} was cancelled"))
        return True

    def preview(self, latents: torch.Tensor) -> np.ndarray:
        """Decode one output's intermediate latents (from ``on_step``, on the engine thread)."""
        return self.model.decode_preview(latents[:1])

    # -- engine thread ---------------------------------------------------------------------------

    def _next_batch(self) -> list[_Item] | None:
        """The batch to run now, ``None`` to wait (call with the lock held)."""
        self._pending = [it for it in self._pending if not it.request.cancelled]
        if not self._pending:
            return None
        first = self._pending[0]
        wait = first.arrived + self.batch_window_s - time.monotonic()
        if wait > 0 and len(self._pending) < self.max_batch_size:
            self._cond.wait(wait)
            return None
        batch = [it for it in self._pending if it.request.shape == first.request.shape][: self.max_batch_size]
        taken = {id(it) for it in batch}
        self._pending = [it for it in self._pending if id(it) not in taken]
        return batch

    def _run(self, batch: list[_Item]) -> None:
        start = time.perf_counter()
        shape = batch[0].request.shape
        rows: dict[int, list[int]] = {}
        reqs: dict[int, _Request] = {}
        for row, it in enumerate(batch):
            rows.setdefault(id(it.request), []).append(row)
            reqs[id(it.request)] = it.request
        for r in reqs.values():
            r.batch_sizes.append(len(batch))

        def on_step(step: int, latents: torch.Tensor) -> None:
            if all(r.cancelled for r in reqs.values()):
                raise StopGeneration
            for key, r in reqs.items():
                if r.on_step is not None and not r.cancelled:
                    try:
                        r.on_step(step, shape.steps, latents[rows[key]])
                    except Exception:  # noqa: BLE001 - a broken observer must not fail the batch
                        logger.exception("on_step callback of %s failed; disabled", r.request_id)
                        r.on_step = None

        try:
            outputs = self.model.generate(shape, [it.item for it in batch], on_step)
        except StopGeneration:
            outputs = None
        except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
            logger.exception("diffusion batch failed")
            for r in reqs.values():
                r.cancelled = True  # drops its items still pending (n > max batch)
                resolve(r, exc)
            return
        with self._cond:
            for row, it in enumerate(batch):
                r = it.request
                if r.cancelled or outputs is None:
                    continue
                if r.out is None:
                    r.out = np.empty((len(r.seeds), *outputs.shape[1:]), dtype=np.float32)
                r.out[it.index] = outputs[row]
                r.remaining -= 1
                if r.remaining == 0:
                    resolve(r, None)
            s = self._stats
            s["num_batches"] += 1
            s["num_outputs"] += len(batch) if outputs is not None else 0
            s["num_cancelled"] += sum(1 for r in reqs.values() if r.cancelled)
            s["busy_s"] += time.perf_counter() - start


def _call_defaults(model: DiffusionModel) -> tuple[int, float]:
    """The pipeline's own ``num_inference_steps`` and ``guidance_scale`` defaults."""
    import inspect

    params = inspect.signature(model.pipe.__call__).parameters
    steps = params["num_inference_steps"].default if "num_inference_steps" in params else 20
    guidance = params["guidance_scale"].default if "guidance_scale" in params else 5.0
    return int(steps or 20), float(guidance if guidance is not None else 5.0)
