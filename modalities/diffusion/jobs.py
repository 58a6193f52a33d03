"""Job kinds ``images.generate`` and ``videos.generate`` (queue ``mmserve.diffusion``).

A submission is charged ``image_steps`` like the online routes (``n x steps``, ``steps x frames``).

``params`` are the bodies of ``/v1/images/generations`` and ``/v1/videos``. Progress is step ``i``
of ``N``; with previews requested each step also carries a PNG of the first output decoded from
the current latents (the first frame for videos). Outputs go to the result store as
``image-<i>.png`` / ``video.mp4``; the job's result lists their URLs and seeds. Cancelling the
job cancels the generation at the next step boundary.
"""

from __future__ import annotations

from typing import Any

from workers.jobs import JobCancelled, JobContext, parse_params, register_job_kind

KINDS = {"images.generate": "image", "videos.generate": "video"}
# Jobs at once per process: the engine batches concurrent ones (one at a time would forgo request
# batching under local dispatch); 16 is also a celery worker's default --concurrency.
CONCURRENCY = 16


def _parse(kind: str, params: dict[str, Any]) -> Any:
    from modalities.diffusion.protocol import ImageGenerationRequest, VideoGenerationRequest

    model = ImageGenerationRequest if KINDS[kind] == "image" else VideoGenerationRequest
    return parse_params(model, params)  # (a 400 in validate)


def _engine(engines: dict[str, Any], aliases: dict[str, str], model: str | None, modality: str) -> tuple[str, Any]:
    """``(served_name, engine)``, resolved as the synchronous routes resolve ``model`` (same 400/404)."""
    from modalities.diffusion.api import pick_generator

    return pick_generator(engines, aliases, model, modality)


def _request(kind: str, body: Any, request_id: str) -> Any:
    from modalities.diffusion.api import _engine_request

    req = _engine_request(body, getattr(body, "n", 1), getattr(body, "num_frames", None))
    req.request_id = request_id
    return req


def _validator(kind: str) -> Any:
    def validate(params: dict[str, Any], engines: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
        """The model resolves as on the synchronous routes (under celery the gateway's engines are
        remote ones with the same names); the stored params name the served model, so a worker,
        which knows no aliases, finds it."""
        body = _parse(kind, params)
        req = _request(kind, body, "validate")  # the size syntax
        name, engine = _engine(engines, aliases, body.model, KINDS[kind])
        if hasattr(engine, "prepare"):
            engine.prepare(req)
        return {**params, "model": name}

    return validate


def _coster(kind: str) -> Any:
    def cost(params: dict[str, Any], engines: dict[str, Any]) -> tuple[str, float]:
        """``image_steps``, as the online routes charge (``modalities.diffusion.api.image_steps``)."""
        from modalities.diffusion.api import image_steps

        body = _parse(kind, params)  # validated: names the served model
        return "image_steps", image_steps(
            _engine(engines, {}, body.model, KINDS[kind])[1], _request(kind, body, "cost")
        )

    return cost


def _runner(kind: str) -> Any:
    async def run(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
        import asyncio

        from modalities.diffusion.engine import GenerationCancelled
        from modalities.diffusion.media import encode_mp4, encode_png

        body = _parse(kind, params)
        _, engine = _engine(ctx.engines, ctx.aliases, body.model, KINDS[kind])
        req = _request(kind, body, f"job-{ctx.job_id}-{ctx.attempt}")

        def on_step(step: int, total: int, latents: Any) -> None:  # on the engine thread
            if ctx.cancelled:
                engine.cancel(req.request_id)
                return
            preview = None
            if ctx.wants_preview:
                pixels = engine.preview(latents)
                preview = encode_png(pixels[0] if pixels.ndim == 4 else pixels)
            ctx.progress(step, total, preview=preview)

        try:
            result = await engine.run(req, on_step=on_step)
        except GenerationCancelled:
            raise JobCancelled(f"job {ctx.job_id} was cancelled") from None
        meta = {"size": f"{result.width}x{result.height}", "steps": result.steps, "cache": result.cache}
        if KINDS[kind] == "image":
            pngs = await asyncio.to_thread(lambda: [encode_png(x) for x in result.outputs])
            urls = [ctx.store.put(ctx.job_id, f"image-{i}.png", png, "image/png") for i, png in enumerate(pngs)]
            return {**meta, "data": [{"url": u, "seed": s} for u, s in zip(urls, result.seeds, strict=True)]}
        mp4 = await asyncio.to_thread(encode_mp4, result.outputs[0], body.fps)
        url = ctx.store.put(ctx.job_id, "video.mp4", mp4, "video/mp4")
        return {**meta, "num_frames": result.num_frames, "fps": body.fps, "seed": result.seeds[0], "url": url}

    return run


def register() -> None:
    """Register both kinds (idempotent: re-registering replaces)."""
    for kind in KINDS:
        register_job_kind(
            kind, "diffusion", _runner(kind), validate=_validator(kind), cost=_coster(kind), concurrency=CONCURRENCY
        )
