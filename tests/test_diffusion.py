"""``DiffusionEngine`` against diffusers itself, on the tiny random pipelines (64x64, 2-4 steps).

- exactness: the engine's output equals the diffusers pipeline called directly at the same seed;
- request batching: concurrent requests of one shape run as one batch, and each output equals the
  same request run alone (max abs diff on [0, 1] pixels < 1e-4);
- step caching: ``off`` is the uncached run exactly; first-block cache (DiT, video) and DeepCache
  (UNet) skip block bodies (counted by hooks) and stay close to the uncached output (PSNR bound);
  our per-request first-block cache equals diffusers' on a lone request, and batching keeps it exact;
- progress per step, cancellation between steps, and 400-class validation before any compute.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from modalities.diffusion.cache import OFF
from modalities.diffusion.engine import DiffusionEngine, GenerateRequest, GenerationCancelled
from modalities.diffusion.tiny import make_tiny, tiny_model_dir

SIDE = 64
TOL = 1e-4  # fp32 noise across batch sizes (observed ~1e-6); far below one 8-bit level (3.9e-3)
# Caching replaces skipped blocks by the residual they produced at the last full step. On these
# random-weight models each step's change is small, so the error stays well under one 8-bit level on
# average: 30 dB PSNR is an RMS error of 3.2% of the range, the usual "visually close" line, and
# far below the 10-15 dB of an unrelated image; observed values are 40-90 dB.
MIN_PSNR = 30.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.fixture(scope="module")
def engines() -> dict[str, DiffusionEngine]:
    torch.manual_seed(0)
    return {
        arch: DiffusionEngine.from_path(str(tiny_model_dir(arch)), batch_window_s=0.3)
        for arch in ("sd-unet", "dit", "video")
    }


def direct(engine: DiffusionEngine, prompt: str, seed: int, steps: int, negative: str = "", **kw: object) -> np.ndarray:
    """The reference: the diffusers pipeline's own ``__call__`` with a plain generator."""
    model = engine.model
    model.cache.set(engine.default_cache)  # no hooks
    args: dict[str, object] = dict(
        height=SIDE,
        width=SIDE,
        num_inference_steps=steps,
        guidance_scale=engine.default_guidance,
        negative_prompt=negative,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    )
    if model.is_video:
        args["num_frames"] = 5
    if "use_resolution_binning" in model.params:
        args.update(use_resolution_binning=False, clean_caption=False)
    out = model.pipe(prompt, **{**args, **kw})
    return np.asarray(out.frames if model.is_video else out.images, dtype=np.float32)[0]


def req(prompt: str, seed: int, steps: int = 3, **kw: object) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, seed=seed, steps=steps, width=SIDE, height=SIDE, **kw)  # type: ignore[arg-type]


def frames_kw(engine: DiffusionEngine) -> dict[str, int]:
    return {"num_frames": 5} if engine.is_video else {}


def digest(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def test_make_tiny_is_deterministic(tmp_path: Path) -> None:
    a, b, c = (make_tiny("dit", tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)
    assert (a / "model_index.json").is_file() and (a / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.parametrize("arch", ["sd-unet", "dit", "video"])
async def test_engine_matches_pipeline(engines: dict[str, DiffusionEngine], arch: str) -> None:
    engine = engines[arch]
    got = await engine.run(req("a red cube on a table", 7, negative_prompt="blurry", **frames_kw(engine)))
    want = direct(engine, "a red cube on a table", 7, 3, negative="blurry")
    assert got.outputs.shape == (1, *want.shape)
    assert np.abs(got.outputs[0] - want).max() < 1e-5
    assert want.std() > 0.01  # the tiny models produce structured, non-constant pixels


@pytest.mark.parametrize("arch", ["dit", "video"])
async def test_batched_equals_alone(engines: dict[str, DiffusionEngine], arch: str) -> None:
    engine = engines[arch]
    fk = frames_kw(engine)
    requests = [
        req("a lighthouse at dusk", 1, **fk),
        req("two cats", 2, negative_prompt="dogs", n=2, **fk),
        req("abstract shapes", 3, guidance_scale=engine.default_guidance, **fk),
    ]
    batched = await asyncio.gather(*(engine.run(r) for r in requests))
    assert [r.batch_sizes for r in batched] == [[4], [4], [4]]  # one batch of 4 outputs
    other = await asyncio.gather(engine.run(req("a lighthouse at dusk", 1, steps=2, **fk)), engine.run(requests[0]))
    assert [r.batch_sizes for r in other] == [[1], [1]]  # another step count never shares a batch
    for r, res in zip(requests, batched, strict=True):
        alone = await engine.run(r)
        assert alone.batch_sizes == [r.n]
        assert res.seeds == alone.seeds
        assert np.abs(res.outputs - alone.outputs).max() < TOL
    single = await engine.run(req("two cats", 3, negative_prompt="dogs", **fk))  # output 2 of n=2 is seed 2+1
    assert np.abs(batched[1].outputs[1] - single.outputs[0]).max() < TOL
    assert np.abs(batched[1].outputs[0] - batched[1].outputs[1]).max() > 0.01  # seeds 2 and 3 differ


def diffusers_fbc(engine: DiffusionEngine, threshold: float, prompt: str, seed: int, steps: int) -> np.ndarray:
    """The reference for our per-request first-block cache: diffusers' own, on a lone request."""
    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    model = engine.model
    model.cache.set(OFF)
    registry = HookRegistry.check_if_exists_or_initialize(model.denoiser)
    apply_first_block_cache(model.denoiser, FirstBlockCacheConfig(threshold=threshold))
    registry.invalidate_child_registries_cache()
    try:
        _set_cache_context(model.denoiser, CacheContext("default"))  # PixArt names no context itself
        return direct(engine, prompt, seed, steps)
    finally:
        registry.remove_hook(_FBC_LEADER_BLOCK_HOOK, recurse=True)
        registry.remove_hook(_FBC_BLOCK_HOOK, recurse=True)
        registry.invalidate_child_registries_cache()


@pytest.mark.parametrize("arch", ["dit", "video"])
async def test_first_block_cache(engines: dict[str, DiffusionEngine], arch: str) -> None:
    engine = engines[arch]
    fk = frames_kw(engine)
    off = await engine.run(req("a mountain lake", 5, steps=8, cache="off", **fk))
    assert np.abs(off.outputs[0] - direct(engine, "a mountain lake", 5, 8)).max() < 1e-5  # off == uncached
    before = engine.stats()
    cached = await engine.run(req("a mountain lake", 5, steps=8, cache=0.2, **fk))
    after = engine.stats()
    assert cached.cache == "fbc@0.2"
    called = after["blocks_called"] - before["blocks_called"]
    skipped = after["blocks_skipped"] - before["blocks_skipped"]
    assert 0 < skipped < called, (arch, skipped, called)
    assert 0 < np.abs(cached.outputs - off.outputs).max()
    assert psnr(cached.outputs, off.outputs) > MIN_PSNR
    # alone, our per-request cache is diffusers' first-block cache
    assert np.abs(cached.outputs[0] - diffusers_fbc(engine, 0.2, "a mountain lake", 5, 8)).max() < 1e-5
    # batched, each request keeps its solo output (its own skip decisions)
    requests = [req(p, s, steps=8, cache=0.2, **fk) for p, s in (("a mountain lake", 5), ("a red car", 6), ("fog", 7))]
    batched = await asyncio.gather(*(engine.run(r) for r in requests))
    assert [r.batch_sizes for r in batched] == [[3]] * 3
    assert np.abs(batched[0].outputs - cached.outputs).max() < TOL
    for r, res in zip(requests[1:], batched[1:], strict=True):
        assert np.abs(res.outputs - (await engine.run(r)).outputs).max() < TOL


async def test_deepcache_unet_skips_and_batches_exactly(engines: dict[str, DiffusionEngine]) -> None:
    engine = engines["sd-unet"]
    off = await engine.run(req("a forest", 11, steps=6))
    before = engine.stats()
    cached = await engine.run(req("a forest", 11, steps=6, cache="medium"))
    after = engine.stats()
    assert cached.cache == "deepcache/3"
    # every 3rd step is full: steps 2, 3, 5, 6 skip the deep modules, twice per step (CFG is one
    # batched call per step in SD), so 4 of 6 calls of each of the 3 deep modules are cached.
    assert after["blocks_skipped"] - before["blocks_skipped"] == 4 * 3
    assert 0 < np.abs(cached.outputs - off.outputs).max()
    assert psnr(cached.outputs, off.outputs) > MIN_PSNR
    # DeepCache's schedule depends only on the step index: batching stays exact
    both = await asyncio.gather(
        engine.run(req("a forest", 11, steps=6, cache="medium")),
        engine.run(req("a river", 12, steps=6, cache="medium")),
    )
    assert [r.batch_sizes for r in both] == [[2], [2]]
    assert np.abs(both[0].outputs - cached.outputs).max() < TOL


async def test_progress_and_cancel(engines: dict[str, DiffusionEngine]) -> None:
    engine = engines["dit"]
    seen: list[tuple[int, int, tuple[int, ...]]] = []
    await engine.run(req("progress", 1, steps=4, n=2), on_step=lambda i, n, lat: seen.append((i, n, tuple(lat.shape))))
    assert [(i, n) for i, n, _ in seen] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert seen[0][2][0] == 2  # this request's latents only
    preview = engine.preview(torch.randn(1, 4, SIDE // 2, SIDE // 2))
    assert preview.shape == (SIDE, SIDE, 3)

    steps_run: list[int] = []
    r = req("cancel me", 2, steps=50, request_id="to-cancel")

    def on_step(i: int, n: int, latents: torch.Tensor) -> None:
        steps_run.append(i)
        if i == 2:
            engine.cancel("to-cancel")

    with pytest.raises(GenerationCancelled):
        await engine.run(r, on_step=on_step)
    ok = await engine.run(req("after", 3, steps=2))  # the engine keeps serving
    assert ok.outputs.shape[0] == 1
    assert max(steps_run) <= 3  # stopped at the next step boundary, not after 50 steps

    # a caller that goes away (its task cancelled: the HTTP client left) stops its batch as well
    before = engine.stats()
    seen.clear()
    task = asyncio.create_task(engine.run(req("left", 4, steps=50), on_step=lambda i, n, lat: seen.append((i, n, ()))))
    while not seen:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.run(req("after", 3, steps=2))
    after = engine.stats()
    assert after["num_cancelled"] == before["num_cancelled"] + 1
    assert after["num_outputs"] == before["num_outputs"] + 1  # only "after": the 50-step batch was dropped


async def test_validation_before_compute(engines: dict[str, DiffusionEngine]) -> None:
    image, video = engines["dit"], engines["video"]
    bad = [
        (image, GenerateRequest(prompt="x", width=62, height=64), "multiple of 8"),
        (image, GenerateRequest(prompt="x", width=4096, height=64), "multiple of 8"),
        (image, GenerateRequest(prompt="  "), "prompt"),
        (image, GenerateRequest(prompt="x", n=11), "n must"),
        (image, GenerateRequest(prompt="x", steps=1000), "steps"),
        (image, GenerateRequest(prompt="x", steps=1), "steps must be between 2"),
        (image, GenerateRequest(prompt="x", cache="nope"), "preset"),
        (image, GenerateRequest(prompt="x", cache_interval=3), "UNet"),
        (image, GenerateRequest(prompt="x", num_frames=5), "image model"),
        (video, GenerateRequest(prompt="x", num_frames=6), "frames, at most"),
        (video, GenerateRequest(prompt="x", num_frames=401), "frames, at most"),
        (video, GenerateRequest(prompt="x", width=40, height=64), "multiple of 16"),
        (engines["sd-unet"], GenerateRequest(prompt="x", cache=0.1), "DeepCache"),
    ]
    batches = {k: e.stats()["num_batches"] for k, e in engines.items()}
    for engine, r, message in bad:
        with pytest.raises(ValueError, match=message):
            await engine.run(r)
    assert {k: e.stats()["num_batches"] for k, e in engines.items()} == batches
