"""``POST /v1/images/generations`` (OpenAI-compatible) and ``POST /v1/videos``.

Both answer synchronously once the generation is done (long work that should not hold a
connection goes through the job API: kinds ``images.generate`` / ``videos.generate``). Every
check that needs no compute (body shape, size multiple, frames, steps, n, prompt, cache
options) runs first and fails with a 400. ``url`` results go to the job result store
(``workers.jobs``) and are served from ``/v1/files/<id>/content``.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.errors import APIError, as_api_error, pick_engine
from gateway.streaming import charged
from modalities.diffusion.protocol import ImageGenerationRequest, VideoGenerationRequest, parse_size

router = APIRouter(tags=["diffusion"], strict_content_type=False)


def resolve_engine(request: Request, model: str | None, modality: str) -> tuple[str, Any]:
    """``(served_name, engine)`` among the engines serving ``modality`` (``image`` or ``video``)."""
    return pick_generator(request.app.state.engines, getattr(request.app.state, "aliases", {}), model, modality)


def pick_generator(
    engines: dict[str, Any], aliases: dict[str, str], model: str | None, modality: str
) -> tuple[str, Any]:
    """:func:`resolve_engine` without a request (the job kinds use it): ``APIError`` 400/404 as the
    routes answer them."""
    matching = {name: e for name, e in engines.items() if getattr(e, "modality", None) == modality}
    flag = "--image" if modality == "image" else "--video"
    return pick_engine(
        engines,
        aliases,
        model,
        matching,
        none_served=f"no {modality} generation model is served (start with {flag})",
        unsupported=f"does not generate {modality}s",
    )


def _engine_request(body: ImageGenerationRequest | VideoGenerationRequest, n: int, num_frames: int | None) -> Any:
    from modalities.diffusion.engine import GenerateRequest

    try:
        width, height = parse_size(body.size)
    except ValueError as exc:
        raise APIError(400, str(exc), param="size", code="invalid_value") from None
    return GenerateRequest(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt or "",
        n=n,
        width=width,
        height=height,
        num_frames=num_frames,
        steps=body.num_steps,
        guidance_scale=body.guidance_scale,
        seed=body.seed,
        cache=body.cache,
        cache_interval=body.cache_interval,
        request_id=f"gen-{secrets.token_hex(8)}",
    )


def image_steps(engine: Any, req: Any) -> int:
    """The ``image_steps`` a generation costs: ``n x steps x frames`` (1 frame for images), with the
    engine's defaults for what ``req`` leaves out. Validates ``req`` (``ValueError``) when the
    engine is local; a remote one (no ``prepare``) is charged the requested numbers."""
    steps, frames = req.steps, req.num_frames
    if hasattr(engine, "prepare"):
        shape, _ = engine.prepare(req)
        steps, frames = shape.steps, shape.num_frames
    return req.n * (steps or 1) * (frames or 1)


async def _generate(request: Request, engine: Any, req: Any) -> Any:
    """Validate (400 before compute), charge ``image_steps``, then run (``gateway.streaming.
    charged``: cancelled when the client leaves); engine errors become OpenAI errors and give the
    charge back."""
    try:
        cost = image_steps(engine, req)
    except Exception as exc:
        raise as_api_error(exc) from None
    try:
        return await charged(request, "image_steps", cost, lambda: engine.run(req))
    except Exception as exc:
        raise as_api_error(exc) from None


async def _store_file(request: Request, data: bytes, filename: str, content_type: str) -> str:
    """Keep ``data`` as a file of the job API (``/v1/files/<id>``, same store and metadata as an
    upload, owned by the caller's tenant) and return its absolute content URL."""
    from workers.jobs.api import owner_of, service
    from workers.jobs.store import UPLOADS, file_url

    svc = service(request.app)
    fid = f"file-{secrets.token_hex(12)}{Path(filename).suffix}"  # the suffix gives the served content type
    await asyncio.to_thread(svc.store.put, UPLOADS, fid, data, content_type)
    meta = {
        "id": fid,
        "object": "file",
        "bytes": len(data),
        "created_at": int(time.time()),
        "filename": filename,
        "purpose": "generation_output",
        "status": "processed",
        "owner": owner_of(request),  # tenant-private, like uploads (file_object hides other tenants' files)
    }
    await svc.backend.put_meta(f"file:{fid}", meta)
    return _absolute(request, file_url(UPLOADS, fid))


def _absolute(request: Request, url: str) -> str:
    return url if "://" in url else str(request.base_url).rstrip("/") + url


@router.post("/v1/images/generations")
async def images_generations(body: ImageGenerationRequest, request: Request) -> JSONResponse:
    from modalities.diffusion.media import encode_png

    name, engine = resolve_engine(request, body.model, "image")
    result = await _generate(request, engine, _engine_request(body, body.n, None))
    pngs = await asyncio.to_thread(lambda: [encode_png(img) for img in result.outputs])
    data: list[dict[str, Any]] = []
    if body.response_format == "url":
        for i, (png, seed) in enumerate(zip(pngs, result.seeds, strict=True)):
            url = await _store_file(request, png, f"image-{i}.png", "image/png")
            data.append({"url": url, "revised_prompt": None, "seed": seed})
    else:
        for png, seed in zip(pngs, result.seeds, strict=True):
            data.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": None, "seed": seed})
    return JSONResponse(
        {
            "created": int(time.time()),
            "model": name,
            "data": data,
            "output_format": "png",
            "size": f"{result.width}x{result.height}",
            "steps": result.steps,
            "cache": result.cache,
        }
    )


@router.post("/v1/videos", response_model=None)
async def videos(body: VideoGenerationRequest, request: Request) -> Response:
    from modalities.diffusion.media import encode_mp4, encode_png

    name, engine = resolve_engine(request, body.model, "video")
    result = await _generate(request, engine, _engine_request(body, 1, body.num_frames))
    frames = result.outputs[0]
    meta = {
        "created": int(time.time()),
        "model": name,
        "size": f"{result.width}x{result.height}",
        "num_frames": result.num_frames,
        "fps": body.fps,
        "seed": result.seeds[0],
        "steps": result.steps,
        "cache": result.cache,
    }
    if body.response_format == "frames":
        pngs = await asyncio.to_thread(lambda: [encode_png(f) for f in frames])
        return JSONResponse({**meta, "frames": [base64.b64encode(p).decode() for p in pngs]})
    mp4 = await asyncio.to_thread(encode_mp4, frames, body.fps)
    if body.response_format == "mp4":
        headers = {f"x-mmserve-{k.replace('_', '-')}": str(v) for k, v in meta.items() if k != "created"}
        return Response(mp4, media_type="video/mp4", headers=headers)
    if body.response_format == "b64_json":
        return JSONResponse({**meta, "b64_json": base64.b64encode(mp4).decode()})
    return JSONResponse({**meta, "url": await _store_file(request, mp4, "video.mp4", "video/mp4")})
