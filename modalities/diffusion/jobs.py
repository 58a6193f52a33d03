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

from workers.jobs import JobCancelled, JobContext, register_job_kind

KINDS = {"images.generate": "image", "videos.generate": "video"}


def _parse(kind: str, params: dict[str, Any]) -> Any:
    from modalities.diffusion.protocol import ImageGenerationRequest, VideoGenerationRequest

    model = ImageGenerationRequest if KINDS[kind] == "image" else VideoGenerationRequest
    try:
        return model.model_validate(params)
    except Exception as exc:  # pydantic's ValidationError: a 400 in validate
        raise ValueError(f"invalid {kind} params: {exc}") from None


def _engine(engines: dict[str, Any], aliases: dict[str, str], model: str | None, modality: str) -> Any:
    matching = {name: e for name, e in engines.items() if getattr(e, "modality", None) == modality}
    if model is None and len(matching) == 1:
        return next(iter(matching.values()))
    name = aliases.get(model, model) if model is not None else None
    if name in matching:
        return matching[name]
    raise ValueError(f"no {modality} generation model {model or ''} is served (models: {', '.join(matching)})")


def _request(kind: str, body: Any, request_id: str) -> Any:
    from modalities.diffusion.api import _engine_request

    req = _engine_request(body, getattr(body, "n", 1), getattr(body, "num_frames", None))
    req.request_id = request_id
    return req


def _validator(kind: str) -> Any:
    def validate(params: dict[str, Any], engines: dict[str, Any]) -> dict[str, Any]:
        body = _parse(kind, params)
        req = _request(kind, body, "validate")  # the size syntax
        if not any(getattr(e, "modality", None) == KINDS[kind] for e in engines.values()):
            return params  # the model lives on workers only (celery dispatch): they check the rest
        engine = _engine(engines, {}, body.model, KINDS[kind])
        if hasattr(engine, "prepare"):
            engine.prepare(req)
        return params

    return validate


def _coster(kind: str) -> Any:
    def cost(params: dict[str, Any], engines: dict[str, Any]) -> tuple[str, float]:
        """``image_steps``, as the online routes charge (``modalities.diffusion.api.image_steps``)."""
        from modalities.diffusion.api import image_steps

        body = _parse(kind, params)
        req = _request(kind, body, "cost")
        local = any(getattr(e, "modality", None) == KINDS[kind] for e in engines.values())
        return "image_steps", image_steps(_engine(engines, {}, body.model, KINDS[kind]) if local else None, req)

    return cost


def _runner(kind: str) -> Any:
    async def run(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
        import asyncio

        from modalities.diffusion.engine import GenerationCancelled
        from modalities.diffusion.media import encode_mp4, encode_png

        body = _parse(kind, params)
        engine = _engine(ctx.engines, ctx.aliases, body.model, KINDS[kind])
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
        register_job_kind(kind, "diffusion", _runner(kind), validate=_validator(kind), cost=_coster(kind))
