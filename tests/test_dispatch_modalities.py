"""TTS and diffusion under ``--dispatch celery``: real Redis (127.0.0.1:6379 db 15, a unique prefix
per run), one ``mmserve worker --modality tts`` (Piper, seeded, one synthesis thread) and one
``--modality diffusion --image tiny-dit`` subprocess, and a real uvicorn gateway. Outputs equal
the same requests run on local engines; validation happens in the gateway (400 before any worker
sees the request); a TTS client that disconnects stops the synthesis on the worker."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from tests.helpers import serve_app
from workers.local_cluster import WorkerProc, start_worker, wait_for_heartbeats
from workers.wire import Keys

REDIS_URL = "redis://127.0.0.1:6379/15"
PREFIX = f"t-dispmod-{uuid.uuid4().hex[:8]}"
TTS_WORKER, DIFF_WORKER = f"{PREFIX}-tts", f"{PREFIX}-diffusion"
TTS_ARGS = ["--tts-workers", "1", "--tts-threads", "1", "--tts-seed", "0"]
TEXT = "Hello there. The quick brown fox jumps over the lazy dog. How are you today?"
IMAGE = {"model": "tiny-dit", "prompt": "a watercolor fox", "size": "32x32", "steps": 2, "seed": 7}
VIDEO = {"model": "tiny-video", "prompt": "waves", "size": "32x32", "num_frames": 5, "steps": 2, "seed": 5}
DIFFUSION_ARGS = ["--image", "tiny-dit", "--video", "tiny-video", "--diffusion-max-batch", "2"]
JOB = {k: v for k, v in IMAGE.items() if k != "model"}  # the only image model


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="module")
def workers(results: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    logs, store = tmp_path_factory.mktemp("workers"), ["--results-dir", str(results)]
    procs = {
        "tts": start_worker("tts", REDIS_URL, PREFIX, [*TTS_ARGS, *store], worker_id=TTS_WORKER, log_dir=logs),
        "diffusion": start_worker(
            "diffusion", REDIS_URL, PREFIX, [*DIFFUSION_ARGS, *store], worker_id=DIFF_WORKER, log_dir=logs
        ),
    }
    try:
        wait_for_heartbeats(REDIS_URL, PREFIX, list(procs.values()))
        yield procs
    finally:
        for p in procs.values():
            p.kill()
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{PREFIX}*", count=1000):
            client.delete(key)


@pytest.fixture(scope="module")
def gateway(workers: dict[str, WorkerProc], results: Path) -> Iterator[str]:
    from gateway.app import build_app
    from gateway.cli import build_parser

    argv = ["serve", "--only", "tts,diffusion", *DIFFUSION_ARGS, "--dispatch", "celery"]
    argv += ["--redis-url", REDIS_URL, "--prefix", PREFIX, "--results-dir", str(results)]
    with serve_app(build_app(build_parser().parse_args(argv))) as url:
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/ready").status_code != 200:
            assert time.monotonic() < deadline, httpx.get(f"{url}/ready").text
            time.sleep(0.2)
        yield url


def _stats(worker_id: str, model: str) -> dict[str, float]:
    """The engine stats of ``model`` in the worker's first heartbeat taken after this call."""
    since, client = time.time(), redis.Redis.from_url(REDIS_URL)
    deadline = since + 30
    while True:
        beat = client.get(Keys(PREFIX).worker(worker_id))
        assert beat is not None, f"{worker_id} is not heartbeating"
        data = json.loads(beat)
        if data["ts"] > since:
            return data["stats"][model]
        assert time.time() < deadline, "no fresh heartbeat"
        time.sleep(0.1)


# -- TTS ---------------------------------------------------------------------------------------
def test_tts_celery_pcm_equals_local(gateway: str) -> None:
    """First request on both sides: the seeded voice gives byte-identical PCM (runs first)."""
    from modalities.audio import StreamEncoder
    from modalities.tts.piper_engine import PiperEngine
    from modalities.tts.protocol import TTSRequest

    req = TTSRequest(TEXT, "joe", 1.0, 24_000)

    async def local() -> bytes:
        engine = PiperEngine(workers=1, threads=1, seed=0)
        encoder = StreamEncoder("pcm", 24_000)
        try:
            data = b"".join([encoder.encode(c) async for c in engine.stream(req)])
        finally:
            await engine.shutdown()
        return data + encoder.close()

    want = asyncio.run(local())
    resp = httpx.post(f"{gateway}/v1/audio/speech", json={"input": TEXT, "response_format": "pcm"}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-model"] == "piper-en_US-joe-medium" and resp.headers["x-sample-rate"] == "24000"
    assert len(want) > 24_000 and resp.content == want
    # The worker's count of what the synthesis read comes back to the gateway (speech.audio.done).
    body = {"input": TEXT, "response_format": "pcm", "stream_format": "sse"}
    sse = httpx.post(f"{gateway}/v1/audio/speech", json=body, timeout=120)
    assert sse.status_code == 200, sse.text
    done = json.loads(sse.text.strip().splitlines()[-1].removeprefix("data: "))
    assert req.usage.input_tokens > len(TEXT) and req.usage.output_tokens == 0
    assert done["usage"] == {
        "input_tokens": req.usage.input_tokens,
        "output_tokens": 0,
        "total_tokens": req.usage.input_tokens,
    }


def test_tts_validation_in_gateway(gateway: str) -> None:
    for body, param in (({"input": TEXT, "voice": "nobody"}, "voice"), ({"input": " ", "voice": "joe"}, "input")):
        resp = httpx.post(f"{gateway}/v1/audio/speech", json=body, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_tts_disconnect_aborts_on_worker(gateway: str) -> None:
    from modalities.tts.text import split_text

    model = "piper-en_US-joe-medium"
    text = " ".join(f"Sentence number {i} is here to make this a long text to read aloud." for i in range(50))
    pieces = len(split_text(text, 300, 60))
    before = _stats(TTS_WORKER, model)["tts_pieces_done"]
    with httpx.stream("POST", f"{gateway}/v1/audio/speech", json={"input": text, "response_format": "pcm"}) as resp:
        assert resp.status_code == 200
        assert next(resp.iter_bytes())  # the first piece arrived; now hang up
    deadline = time.monotonic() + 20
    while True:
        stats = _stats(TTS_WORKER, model)
        if stats["tts_requests_active"] == 0 and stats["tts_requests_queued"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    time.sleep(1.5)  # a piece running at the abort still finishes; nothing after it may start
    assert _stats(TTS_WORKER, model)["tts_pieces_done"] - before < 10, pieces  # 50 pieces; about 2 ran


def test_ar_tts_proxy_matches_the_engine(tmp_path: Path) -> None:
    """``--tts-ar``: the proxy's name and voice metadata (read from the files) are the engine's."""
    from modalities.tts.ar_engine import ARTTSEngine
    from modalities.tts.remote import RemoteTTSEngine
    from modalities.tts.tiny import tiny_tts_ar_dir
    from workers.remote import Cluster

    path = tiny_tts_ar_dir(seed=0)
    proxy = RemoteTTSEngine.autoregressive(Cluster(REDIS_URL, prefix=PREFIX), path)
    engine = ARTTSEngine.from_dir(path, num_kv_blocks=16)
    got = (proxy.model_name, proxy.voices, proxy.sample_rate, proxy.supports_speed, proxy.modality)
    assert got == (engine.model_name, engine.voices, engine.sample_rate, engine.supports_speed, engine.modality)


# -- diffusion ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dit_local() -> Any:
    from modalities.diffusion.engine import DiffusionEngine
    from modalities.diffusion.plugin import resolve_pipeline_path

    return DiffusionEngine.from_path(str(resolve_pipeline_path("tiny-dit")))


@pytest.mark.parametrize("arch", ["sd-unet", "dit", "video"])
def test_skeleton_validates_like_the_loaded_pipeline(arch: str) -> None:
    """The gateway's weightless engine accepts and shapes every request as the loaded one does."""
    from modalities.diffusion.engine import DiffusionEngine, GenerateRequest
    from modalities.diffusion.plugin import resolve_pipeline_path

    path = str(resolve_pipeline_path(f"tiny-{arch}"))
    loaded, skeleton = (DiffusionEngine.from_path(path, weights=w, max_side=256) for w in (True, False))
    assert next(skeleton.model.denoiser.parameters()).is_meta
    for side in (None, 8, 16, 24, 30, 32, 48, 64, 300):
        for frames in (None, 1, 5, 8, 9):
            for steps, cache in ((None, None), (1, "light"), (3, 0.1), (101, None)):
                req = GenerateRequest("x", width=side, height=side, num_frames=frames, steps=steps, cache=cache, seed=1)
                results = []
                for engine in (loaded, skeleton):
                    try:
                        results.append(engine.prepare(req))
                    except ValueError as exc:
                        results.append(str(exc))
                assert results[0] == results[1], (req, results)


def _png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_diffusion_proxy_equals_local_engine(workers: dict[str, WorkerProc], dit_local: Any) -> None:
    """The proxy's result (float pixels, seeds, shape) equals the local engine's at the same seed."""
    from modalities.diffusion.engine import GenerateRequest
    from modalities.diffusion.plugin import remote_engines
    from workers.remote import Cluster

    req = GenerateRequest("a watercolor fox", n=2, width=32, height=32, steps=2, seed=7)
    args = type("Args", (), {"image": "tiny-dit", "video": None})()

    async def remote() -> Any:
        cluster = Cluster(REDIS_URL, prefix=PREFIX)
        (engine,) = remote_engines(args, cluster).engines.values()
        await engine.start()
        try:
            assert engine.prepare(req)[1] == [7, 8]  # validated here, from the configs
            return await engine.run(req)
        finally:
            await engine.shutdown()

    got = asyncio.run(remote())
    want = asyncio.run(dit_local.run(req))
    assert got.seeds == want.seeds and (got.width, got.height, got.steps) == (want.width, want.height, want.steps)
    np.testing.assert_allclose(got.outputs, want.outputs, atol=1e-4, rtol=0)


def test_images_generations_over_celery(gateway: str, dit_local: Any) -> None:
    from modalities.diffusion.engine import GenerateRequest
    from modalities.diffusion.media import encode_png

    resp = httpx.post(f"{gateway}/v1/images/generations", json=IMAGE, timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == "diffusion-dit-0" and body["size"] == "32x32" and body["data"][0]["seed"] == 7
    want = asyncio.run(dit_local.run(GenerateRequest("a watercolor fox", width=32, height=32, steps=2, seed=7)))
    got, ref = _png(base64.b64decode(body["data"][0]["b64_json"])), _png(encode_png(want.outputs[0]))
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1  # fp32 noise may flip a rounding


def test_videos_over_celery(gateway: str) -> None:
    from modalities.diffusion.engine import DiffusionEngine, GenerateRequest
    from modalities.diffusion.media import encode_png
    from modalities.diffusion.plugin import resolve_pipeline_path

    resp = httpx.post(f"{gateway}/v1/videos", json={**VIDEO, "response_format": "frames"}, timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == "diffusion-video-0" and body["num_frames"] == 5 and body["seed"] == 5
    engine = DiffusionEngine.from_path(str(resolve_pipeline_path("tiny-video")))
    want = asyncio.run(engine.run(GenerateRequest("waves", width=32, height=32, num_frames=5, steps=2, seed=5)))
    for frame, ref in zip(body["frames"], want.outputs[0], strict=True):
        diff = _png(base64.b64decode(frame)).astype(int) - _png(encode_png(ref)).astype(int)
        assert np.abs(diff).max() <= 1


def test_bad_requests_are_400_in_gateway(gateway: str) -> None:
    requests_before = _stats(DIFF_WORKER, "diffusion-dit-0")["num_requests"]
    for patch, needle in ((("size", "30x30"), "multiple of"), (("steps", 1000), "steps"), (("n", 50), "n must")):
        resp = httpx.post(f"{gateway}/v1/images/generations", json=dict([*IMAGE.items(), patch]), timeout=30)
        assert resp.status_code == 400 and needle in resp.json()["error"]["message"], resp.text
    params = {**JOB, "size": "30x30"}
    job = httpx.post(f"{gateway}/v1/jobs", json={"kind": "images.generate", "params": params}, timeout=30)
    assert job.status_code == 400 and "multiple of" in job.json()["error"]["message"], job.text
    resp = httpx.post(f"{gateway}/v1/videos", json={**VIDEO, "num_frames": 8}, timeout=30)
    assert resp.status_code == 400 and "4k+1" in resp.json()["error"]["message"], resp.text
    assert _stats(DIFF_WORKER, "diffusion-dit-0")["num_requests"] == requests_before


def test_images_generate_job_over_celery(gateway: str) -> None:
    resp = httpx.post(f"{gateway}/v1/jobs", json={"kind": "images.generate", "params": JOB}, timeout=30)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{gateway}/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    assert job["status"] == "succeeded", job
    assert job["result"]["size"] == "32x32" and job["result"]["data"][0]["seed"] == 7
    url = job["result"]["data"][0]["url"]
    image = httpx.get(url if "://" in url else f"{gateway}{url}")
    assert image.status_code == 200 and _png(image.content).shape == (32, 32, 3)
