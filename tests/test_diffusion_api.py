"""``/v1/images/generations`` and ``/v1/videos`` end to end: a real uvicorn server on the tiny DiT
and video pipelines, the official ``openai`` client for images, PyAV to decode the MP4, the job
API (``images.generate`` with progress previews) and 400s for bad input before any compute."""

from __future__ import annotations

import argparse
import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from modalities.diffusion.engine import DiffusionEngine, GenerateRequest
from modalities.diffusion.media import decode_mp4, to_uint8
from modalities.diffusion.tiny import tiny_model_dir
from tests.helpers import serve_app

API_KEY = "test-key"
IMAGE, VIDEO = "tiny-dit", "tiny-video"
ALIAS = "dit-alias"


class Server:
    def __init__(self, base_url: str, engines: dict[str, DiffusionEngine]) -> None:
        self.base_url, self.engines = base_url, engines
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return httpx.post(f"{self.base_url}{path}", json=body, headers=self.headers, timeout=120, **kw)

    def get(self, url: str) -> httpx.Response:
        return httpx.get(url if "://" in url else f"{self.base_url}{url}", headers=self.headers, timeout=60)

    def reference(self, name: str, **kw: Any) -> np.ndarray:
        """The engine's own output (tests/test_diffusion.py proves it equals diffusers')."""
        import asyncio

        return asyncio.run(self.engines[name].run(GenerateRequest(**kw))).outputs


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from gateway.app import create_app

    engines = {
        IMAGE: DiffusionEngine.from_path(str(tiny_model_dir("dit")), served_name=IMAGE),
        VIDEO: DiffusionEngine.from_path(str(tiny_model_dir("video")), served_name=VIDEO, max_frames=33),
    }
    app = create_app(engines, api_key=API_KEY, aliases={ALIAS: IMAGE})
    app.state.args = argparse.Namespace(results_dir=str(tmp_path_factory.mktemp("results")), dispatch="local")
    with serve_app(app) as base_url:
        yield Server(base_url, engines)


def png_pixels(data: bytes) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    assert img.format == "PNG"
    return np.asarray(img.convert("RGB"))


def test_openai_client_images(server: Server) -> None:
    client = server.client()
    extra = {"steps": 3, "seed": 42, "negative_prompt": "blurry"}
    res = client.images.generate(model=IMAGE, prompt="a watercolor fox", n=2, size="64x48", extra_body=extra)
    assert len(res.data) == 2
    want = to_uint8(server.reference(IMAGE, prompt="a watercolor fox", n=2, width=64, height=48, **extra))
    for i, d in enumerate(res.data):
        got = png_pixels(base64.b64decode(d.b64_json))
        assert got.shape == (48, 64, 3)
        assert np.abs(got.astype(int) - want[i].astype(int)).max() <= 1  # fp32 noise may flip a rounding
    # url responses are stored in the job result store and served by /v1/files
    res = client.images.generate(prompt="a watercolor fox", size="64x48", response_format="url", extra_body=extra)
    fetched = server.get(res.data[0].url)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert np.abs(png_pixels(fetched.content).astype(int) - want[0].astype(int)).max() <= 1


def test_image_cache_option(server: Server) -> None:
    body = {"model": IMAGE, "prompt": "a lake", "size": "64x64", "steps": 6, "seed": 1}
    off = server.post("/v1/images/generations", body).json()
    on = server.post("/v1/images/generations", {**body, "cache": "aggressive"}).json()
    assert off["cache"] == "off" and on["cache"] == "fbc@0.2"
    a, b = (png_pixels(base64.b64decode(r["data"][0]["b64_json"])) for r in (off, on))
    assert np.abs(a.astype(int) - b.astype(int)).mean() < 8  # close, see the PSNR test in test_diffusion.py


def test_video_mp4_and_frames(server: Server) -> None:
    body = {"model": VIDEO, "prompt": "waves", "size": "64x48", "num_frames": 9, "steps": 3, "seed": 5, "fps": 8}
    r = server.post("/v1/videos", body)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    frames = decode_mp4(r.content)
    want = to_uint8(server.reference(VIDEO, prompt="waves", width=64, height=48, num_frames=9, steps=3, seed=5))[0]
    assert frames.shape == want.shape == (9, 48, 64, 3)
    # H.264 is lossy and 4:2:0 halves chroma resolution, which costs most on these random-noise
    # pixels; it must still be the same video: far closer than the same frames shifted by 8 px.
    err = np.abs(frames.astype(int) - want.astype(int)).mean()
    assert err < 12 and err < 0.5 * np.abs(frames.astype(int) - np.roll(want, 8, axis=2).astype(int)).mean()
    js = server.post("/v1/videos", {**body, "response_format": "frames"}).json()
    assert js["num_frames"] == 9 and js["fps"] == 8
    pngs = np.stack([png_pixels(base64.b64decode(f)) for f in js["frames"]])
    assert np.abs(pngs.astype(int) - want.astype(int)).max() <= 1  # PNG is lossless


@pytest.mark.parametrize(
    ("path", "body", "param_or_text"),
    [
        ("/v1/images/generations", {"prompt": "x", "size": "60x64"}, "multiple of 8"),
        ("/v1/images/generations", {"prompt": "x", "size": "4096x4096"}, "multiple of 8"),
        ("/v1/images/generations", {"prompt": "x", "size": "0x64"}, "multiple of 8"),  # (0 is not "unset")
        ("/v1/images/generations", {"prompt": "x", "size": "big"}, "size"),
        ("/v1/images/generations", {"prompt": ""}, "prompt"),
        ("/v1/images/generations", {"prompt": "x", "n": 50}, "n must"),
        ("/v1/images/generations", {"prompt": "x", "steps": 5000}, "steps"),
        ("/v1/images/generations", {"prompt": "x", "cache": "warp"}, "preset"),
        ("/v1/images/generations", {"prompt": "x", "response_format": "gif"}, "response_format"),
        ("/v1/images/generations", {"prompt": "x", "model": VIDEO}, "does not generate images"),
        ("/v1/videos", {"prompt": "x", "num_frames": 8}, "4k+1"),
        ("/v1/videos", {"prompt": "x", "num_frames": 101}, "at most 33"),
        ("/v1/videos", {"prompt": "x", "size": "64x40"}, "multiple of 16"),
        ("/v1/videos", {"prompt": "x", "size": "0x0"}, "multiple of 16"),
        ("/v1/videos", {"prompt": "   "}, "prompt"),
        ("/v1/videos", {"prompt": "x", "n": 2}, "n must be 1"),
    ],
)
def test_bad_input_is_400(server: Server, path: str, body: dict[str, Any], param_or_text: str) -> None:
    batches = {k: e.stats()["num_batches"] for k, e in server.engines.items()}
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert param_or_text in r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"], error  # (the field is named)
    assert {k: e.stats()["num_batches"] for k, e in server.engines.items()} == batches  # no compute


def test_unknown_model_404_and_client_error(server: Server) -> None:
    assert server.post("/v1/images/generations", {"prompt": "x", "model": "nope"}).status_code == 404
    with pytest.raises(openai.BadRequestError):
        server.client().images.generate(model=IMAGE, prompt="x", size="63x63")


def test_image_job_with_progress(server: Server, tmp_path: Path) -> None:
    params = {"model": IMAGE, "prompt": "a job", "size": "64x64", "steps": 3, "seed": 9}
    r = server.post("/v1/jobs", {"kind": "images.generate", "params": params, "preview": True})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 60
    while (job := server.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert job["status"] == "succeeded", job
    events = server.get(f"/v1/jobs/{job_id}/events?previews=true").text
    assert events.count("event: progress") == 3 and '"preview_type": "image/png"' in events
    png = server.get(job["result"]["data"][0]["url"]).content
    want = to_uint8(server.reference(IMAGE, prompt="a job", width=64, height=64, steps=3, seed=9))[0]
    assert np.abs(png_pixels(png).astype(int) - want.astype(int)).max() <= 1
    bad = server.post("/v1/jobs", {"kind": "images.generate", "params": {**params, "size": "10x10"}})
    assert bad.status_code == 400 and "multiple of 8" in bad.text
    garbled = server.post("/v1/jobs", {"kind": "images.generate", "params": {**params, "size": "big"}})
    assert garbled.status_code == 400 and garbled.json()["error"]["param"] == "params.size", garbled.text


def test_job_models_resolve_like_the_routes(server: Server) -> None:
    """``images.generate``/``videos.generate`` params name models as the routes do: same 400/404s,
    and an alias runs on its served model (the stored params name it, for workers)."""
    cases = [
        ("nope", "images.generate", "/v1/images/generations"),  # unknown: 404
        (VIDEO, "images.generate", "/v1/images/generations"),  # served, but not an image model: 400
        (ALIAS, "videos.generate", "/v1/videos"),
    ]
    for model, kind, route in cases:
        sync = server.post(route, {"prompt": "x", "model": model})
        job = server.post("/v1/jobs", {"kind": kind, "params": {"prompt": "x", "model": model}})
        assert sync.status_code in (400, 404) and job.status_code == sync.status_code, (model, job.text)
        assert job.json()["error"] == {**sync.json()["error"], "param": "params.model"}
    params = {"model": ALIAS, "prompt": "alias", "size": "32x32", "steps": 2, "seed": 3}
    r = server.post("/v1/jobs", {"kind": "images.generate", "params": params})
    assert r.status_code == 202, r.text
    assert r.json()["params"]["model"] == IMAGE
    deadline = time.monotonic() + 60
    while (job := server.get(f"/v1/jobs/{r.json()['id']}").json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert job["status"] == "succeeded", job


def test_a_client_that_leaves_stops_the_generation(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client gone from an image request stops its denoising loop at the next step: the loop
    is held at its second step until the server has had time to see the client leave (it polls
    every 0.2 s); released, it must stop there (before, it ran every step and made the image)."""
    import threading

    engine = server.engines[IMAGE]
    real_generate, release, steps = engine.model.generate, threading.Event(), [0]

    def held_generate(shape: Any, items: Any, on_step: Any) -> Any:
        def step(i: int, latents: Any) -> None:
            steps[0] += 1
            if steps[0] == 2:
                release.wait(30)
            on_step(i, latents)

        return real_generate(shape, items, step)

    monkeypatch.setattr(engine.model, "generate", held_generate)
    before = engine.stats()
    body = {"model": IMAGE, "prompt": "a fox", "size": "64x64", "steps": 20}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.base_url}/v1/images/generations",
                json=body,
                headers=server.headers,
                timeout=httpx.Timeout(60, read=1.0),
            )
        deadline = time.monotonic() + 10
        while steps[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the server sees the client gone and cancels the request
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while engine.stats()["num_cancelled"] == before["num_cancelled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = engine.stats()
    assert after["num_cancelled"] == before["num_cancelled"] + 1
    assert after["num_outputs"] == before["num_outputs"]
    assert steps[0] == 2  # stopped at the held step, not after all 20
