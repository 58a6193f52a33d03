"""Context parallelism: N ranks (gloo, loopback) give the single-process output, and the bytes they
send are exactly the analytic volume.

- hooks, 4 ranks: Ulysses 4, ring 4 and hybrid 2x2 on tiny random PixArt, SD3, Flux and Wan
  transformers (every plan), against the same model unhooked in the same process;
- runner, 2 ranks: the tiny PixArt and Wan pipelines end to end (decoded pixels in [0, 1]) against
  ``DiffusionModel.generate``, uncached and with the first-block cache (same skipped blocks, the
  skip decision all-reduced); bad sizes are a ``ValueError`` without wedging the ranks; a cancel
  from ``on_step`` stops every rank and the next request still works.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore")

WORLD = 4


def _models() -> dict[str, tuple[torch.nn.Module, dict, object]]:
    """name -> (model, inputs, ForwardShape for the byte check); fixed seeds, batch 2."""
    from diffusers import (
        FluxTransformer2DModel,
        PixArtTransformer2DModel,
        SD3Transformer2DModel,
        WanTransformer3DModel,
    )

    from modalities.diffusion.parallel.volume import ForwardShape, dit_forward_shape

    g = torch.Generator().manual_seed(1)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    out = {}
    torch.manual_seed(0)
    pix = PixArtTransformer2DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=32, caption_channels=24, sample_size=8, patch_size=2, norm_type="ada_norm_single",
        use_additional_conditions=False,
    ).eval()  # fmt: skip
    inputs = dict(hidden_states=rnd(2, 4, 8, 8), encoder_hidden_states=rnd(2, 6, 24), timestep=torch.tensor([9, 9]))
    out["pixart"] = (pix, inputs, dit_forward_shape(pix, latent_hw=(8, 8), batch=2))
    torch.manual_seed(0)
    sd3 = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=16,
        pos_embed_max_size=16, dual_attention_layers=(0,),
    ).eval()  # fmt: skip
    inputs = dict(
        hidden_states=rnd(2, 4, 8, 8), encoder_hidden_states=rnd(2, 8, 24), pooled_projections=rnd(2, 16),
        timestep=torch.tensor([9, 9]),
    )  # fmt: skip
    # 2 joint layers + SD3.5's extra image self-attention in layer 0; out: 16 image tokens x (2*2*4).
    out["sd3"] = (sd3, inputs, (ForwardShape(2, 16 + 8, 4, 8, 2, 16, 16), ForwardShape(2, 16, 4, 8, 1, 16, 0)))
    torch.manual_seed(0)
    flux = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=24, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
    ).eval()  # fmt: skip
    inputs = dict(
        hidden_states=rnd(2, 16, 16), encoder_hidden_states=rnd(2, 8, 24), pooled_projections=rnd(2, 16),
        timestep=torch.tensor([0.5, 0.5]), img_ids=rnd(16, 3), txt_ids=torch.zeros(8, 3),
    )  # fmt: skip
    out["flux"] = (flux, inputs, ForwardShape(2, 16 + 8, 4, 8, 2, 16, 16))
    torch.manual_seed(0)
    wan = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32, qk_norm="rms_norm_across_heads",
    ).eval()  # fmt: skip
    inputs = dict(hidden_states=rnd(2, 4, 4, 4, 4), encoder_hidden_states=rnd(2, 6, 24), timestep=torch.tensor([9, 9]))
    out["wan"] = (wan, inputs, dit_forward_shape(wan, latent_hw=(4, 4), latent_frames=4, batch=2))
    return out


def _hooks_rank(rank: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    from modalities.diffusion.parallel import ContextParallelConfig, CPGroups, apply_context_parallel
    from modalities.diffusion.parallel.volume import bytes_per_forward

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    models = _models()
    refs = {}
    for name, (model, inputs, _) in models.items():
        with torch.no_grad():
            refs[name] = model(**inputs, return_dict=False)[0]
    for mode in ("ulysses", "ring", "hybrid"):
        cfg = ContextParallelConfig.for_degree(WORLD, mode)
        groups = CPGroups(cfg)
        for name, (model, inputs, shape) in models.items():
            handle = apply_context_parallel(model, groups)
            groups.counter.reset()
            with torch.no_grad():
                got = model(**inputs, return_dict=False)[0]
            handle.remove()
            expected: dict[str, int] = {}
            for s in shape if isinstance(shape, tuple) else (shape,):
                for k, v in bytes_per_forward(cfg, s).items():
                    expected[k] = expected.get(k, 0) + v
            results[f"{mode}/{name}"] = {
                "max_abs_diff": float((got - refs[name]).abs().max()),
                "measured": dict(groups.counter.bytes),
                "expected": expected,
            }
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def test_hooks_match_single_process_and_bytes_match_formula(tmp_path: Path) -> None:
    from modalities.diffusion.parallel.runner import _free_port, rank_context

    out = tmp_path / "hooks.json"
    rank_context()  # (the ranks' fork server, with its preload)
    torch.multiprocessing.start_processes(
        _hooks_rank, args=(_free_port(), str(out)), nprocs=WORLD, start_method="forkserver"
    )
    results = json.loads(out.read_text())
    assert len(results) == 12
    for key, r in results.items():
        assert r["max_abs_diff"] < 1e-4, (key, r)
        assert r["measured"] == r["expected"], (key, r)
        assert sum(r["measured"].values()) > 0


# -- end to end: the runner on the tiny pipelines ------------------------------------------------


def _shape(model, steps: int = 3, cache=None):
    from modalities.diffusion.cache import OFF
    from modalities.diffusion.model import Shape

    frames = 5 if model.is_video else 1
    return Shape(width=32, height=32, num_frames=frames, steps=steps, guidance_scale=4.0, cache=cache or OFF)


@pytest.fixture(scope="module", params=[("dit", "ulysses"), ("video", "ring")], ids=["dit-ulysses", "video-ring"])
def pair(request):
    from modalities.diffusion.model import DiffusionModel
    from modalities.diffusion.parallel import ContextParallelRunner
    from modalities.diffusion.tiny import tiny_model_dir

    path = tiny_model_dir(request.param[0])
    runner = ContextParallelRunner(path, degree=2, mode=request.param[1], threads_per_rank=1)
    runner.start()
    yield DiffusionModel(path), runner
    runner.close()


def test_runner_matches_single_process(pair) -> None:
    from modalities.diffusion.model import Item

    model, runner = pair
    assert runner.preloaded  # (forked from the fork server with diffusers imported)
    torch.set_num_threads(1)
    items = [Item("a red cat", "", 7), Item("two dogs", "blurry", 8)]
    shape = _shape(model)
    want = model.generate(shape, items)
    got = runner.generate(shape, items)
    assert got.shape == want.shape and got.dtype == np.float32
    diff = float(np.abs(got - want).max())
    print(f"{model.name} {runner.config}: max abs diff on decoded pixels {diff:.3g}", runner.last_stats)
    assert diff < 1e-3
    stats = runner.last_stats
    assert stats["bytes_per_step"] == stats["expected_bytes_per_step"] > 0
    assert stats["forwards"] == shape.steps * (2 if model.is_video else 1)  # Wan runs CFG as two forwards


def test_runner_first_block_cache_matches_single_process(pair) -> None:
    """Same skipped blocks and the same pixels as one process with the same cache setting."""
    from modalities.diffusion.cache import CacheSpec
    from modalities.diffusion.model import Item

    model, runner = pair
    assert runner.preloaded  # (forked from the fork server with diffusers imported)
    torch.set_num_threads(1)
    items = [Item("a red cat", "", 7), Item("two dogs", "blurry", 8)]
    shape = _shape(model, steps=8, cache=CacheSpec("fbc", threshold=0.2))
    calls, run = model.counter.calls, model.counter.run
    want = model.generate(shape, items)
    want_calls, want_run = model.counter.calls - calls, model.counter.run - run
    got = runner.generate(shape, items)
    stats = runner.last_stats
    diff = float(np.abs(got - want).max())
    print(f"{model.name} {runner.config} cached: max abs diff {diff:.3g}, blocks run {want_run}/{want_calls}", stats)
    assert 0 < want_run < want_calls  # the cache skipped some blocks, not all
    assert (stats["blocks_called"], stats["blocks_run"]) == (want_calls, want_run)
    assert diff < 1e-3
    assert stats["measured"]["reduce"] > 0
    assert stats["bytes_per_step"] == stats["expected_bytes_per_step"]  # skipped blocks sent nothing
    uncached = runner.generate(_shape(model, steps=8), items)  # the hooks come off again
    assert runner.last_stats["blocks_run"] == runner.last_stats["blocks_called"]
    assert float(np.abs(uncached - model.generate(_shape(model, steps=8), items)).max()) < 1e-3


def test_runner_rejects_bad_input_then_still_works(pair) -> None:
    from dataclasses import replace

    from modalities.diffusion.model import Item

    model, runner = pair
    items = [Item("x", "", 1)]
    if model.is_video:  # 48 px, one frame: 3x3 patches, an odd token count (the image sizes all shard by 2)
        with pytest.raises(ValueError, match="divisible"):
            runner.generate(replace(_shape(model), width=48, height=48, num_frames=1), items)
    shape = _shape(model, steps=2)
    assert np.abs(runner.generate(shape, items) - model.generate(shape, items)).max() < 1e-3


def test_runner_cancel_stops_every_rank(pair) -> None:
    from modalities.diffusion.model import Item, StopGeneration

    model, runner = pair
    seen: list[int] = []

    def on_step(i: int, latents: torch.Tensor) -> None:
        seen.append(i)
        raise StopGeneration

    with pytest.raises(StopGeneration):
        runner.generate(_shape(model, steps=6), [Item("x", "", 1)], on_step=on_step)
    assert seen == [1]
    assert runner.generate(_shape(model, steps=2), [Item("y", "", 2)]).shape[0] == 1
    assert all(p.is_alive() for p in runner._procs)


async def test_engine_serves_through_the_ranks(pair) -> None:
    """What ``mmserve serve --cp-degree 2`` does: the engine batches, the ranks generate."""
    from modalities.diffusion.engine import DiffusionEngine, GenerateRequest
    from modalities.diffusion.parallel.serving import ContextParallelModel

    model, runner = pair
    plain, cp = DiffusionEngine(model), DiffusionEngine(model)
    cp.model = ContextParallelModel(model, runner)
    frames = {"num_frames": 5} if model.is_video else {}
    req = GenerateRequest("a blue house", n=2, width=32, height=32, steps=2, seed=11, **frames)
    for engine in (plain, cp):
        await engine.start()
    try:
        want, got = await plain.run(req), await cp.run(req)
        assert float(np.abs(got.outputs - want.outputs).max()) < 1e-3
        if model.is_video:
            odd = GenerateRequest("x", width=48, height=48, num_frames=1)
            plain.prepare(odd)  # fine on one process ...
            with pytest.raises(ValueError, match="divisible"):  # ... a 400 before compute with CP
                cp.prepare(odd)
    finally:
        for engine in (plain, cp):
            await engine.shutdown()


def test_server_copy_released_keeps_validation_and_previews(pair) -> None:
    """``--cp-degree``: the serving process frees its denoiser and text encoders (the ranks hold
    them) and still validates sizes and decodes previews exactly as before."""
    from modalities.diffusion.model import DiffusionModel, Item
    from modalities.diffusion.parallel.serving import ContextParallelModel, release_generation_weights

    shared, runner = pair
    seen: list[torch.Tensor] = []
    shape = _shape(shared, steps=2)
    runner.generate(shape, [Item("x", "", 1)], on_step=lambda i, latents: seen.append(latents))
    model = DiffusionModel(runner.path)
    preview = model.decode_preview(seen[-1])
    assert release_generation_weights(model) > 0
    assert all(p.device.type == "meta" for p in model.denoiser.parameters())
    served = ContextParallelModel(model, runner)
    assert served.check_shape(32, 32, shape.num_frames) == shape.num_frames
    assert np.array_equal(served.decode_preview(seen[-1]), preview)


def test_configs_and_unsupported_models_are_rejected() -> None:
    from diffusers import UNet2DModel

    from modalities.diffusion.parallel import ContextParallelConfig
    from modalities.diffusion.parallel.plans import plan_for

    assert ContextParallelConfig.for_degree(4, "hybrid") == ContextParallelConfig(ulysses_degree=2, ring_degree=2)
    for bad in ((3, "hybrid"), (2, "zigzag")):
        with pytest.raises(ValueError):
            ContextParallelConfig.for_degree(*bad)
    with pytest.raises(ValueError, match="no context-parallel plan"):
        plan_for(
            UNet2DModel(
                block_out_channels=(8, 16),
                norm_num_groups=8,
                down_block_types=("DownBlock2D",) * 2,
                up_block_types=("UpBlock2D",) * 2,
            )
        )
