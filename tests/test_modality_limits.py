"""Per-tenant rate limits of the diffusion and TTS routes over real HTTP: one uvicorn server with
the tiny DiT and video engines and the real Piper voice, tenants from a keys file. A tenant over
its ``image_steps`` / ``audio_seconds`` budget gets 429 + ``Retry-After`` while another tenant
with the same limits does not; invalid requests cost nothing, failed ones are refunded, and TTS
is settled to the duration actually synthesised.

Budgets refill at ``limit / 60`` per second, so each 429 below leaves a margin of tens of seconds
of refill (a loaded machine must not turn it into a 200)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.auth import KeyStore, hash_key
from gateway.errors import EngineDeadError
from gateway.ratelimit import MemoryRateLimiter
from modalities.diffusion.engine import DiffusionEngine, GenerateRequest, GenerateResult
from modalities.diffusion.tiny import tiny_model_dir
from modalities.tts.piper_engine import PiperEngine
from tests.helpers import serve_app

IMAGE, VIDEO = "tiny-dit", "tiny-video"
KEYS = {"acme": "k-acme", "other": "k-other", "batch": "k-batch"}
LIMITS = {"image_steps": 30, "audio_seconds": 10}
TEXT = "Hello there. The quick brown fox jumps over the lazy dog. How are you today?"


class RecordingLimiter(MemoryRateLimiter):
    """The in-memory limiter, recording every ``adjust`` (settle/refund) as ``(key, amount)``."""

    def __init__(self) -> None:
        super().__init__()
        self.adjusts: list[tuple[str, float]] = []

    async def adjust(self, key: str, amount: float, limit_per_min: float) -> None:
        self.adjusts.append((key, amount))
        await super().adjust(key, amount, limit_per_min)


class FailingDiffusion(DiffusionEngine):
    """The real engine; a prompt "boom" dies after validation, as a crashed worker would."""

    async def run(self, req: GenerateRequest, on_step: Any = None) -> GenerateResult:
        if req.prompt == "boom":
            raise EngineDeadError("simulated crash")
        return await super().run(req, on_step)


class FailingPiper(PiperEngine):
    """The real voice; text starting with "Boom" fails in synthesis."""

    def _make(self, voice: Any, item: Any) -> Any:
        if item.job.pieces[item.piece].startswith("Boom"):
            raise RuntimeError("simulated synthesis failure")
        return super()._make(voice, item)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RecordingLimiter, PiperEngine]]:
    from gateway.app import create_app
    from modalities.diffusion.plugin import router as diffusion_router  # (plugins register the job kinds)
    from modalities.tts.plugin import router as tts_router
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobsConfig, JobService

    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    tenants = {name: {"keys": [hash_key(key)], "limits": LIMITS} for name, key in KEYS.items()}
    keys.write_text(json.dumps({"tenants": tenants}))
    tts = FailingPiper(workers=1, threads=1)
    engines = {
        IMAGE: FailingDiffusion.from_path(str(tiny_model_dir("dit")), served_name=IMAGE),
        VIDEO: DiffusionEngine.from_path(str(tiny_model_dir("video")), served_name=VIDEO, max_frames=33),
        tts.model_name: tts,
    }
    limiter = RecordingLimiter()
    app = create_app(
        engines,
        routers=[diffusion_router, tts_router, jobs_router],
        keys=KeyStore.from_file(Path(keys)),
        ratelimiter=limiter,
    )
    results = tmp_path_factory.mktemp("results")
    app.state.jobs = JobService(JobsConfig(store={"type": "local", "root": str(results)}), app.state.engines)
    with serve_app(app) as url:
        yield url, limiter, tts


def _post(url: str, tenant: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", **headers}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def _assert_throttled(resp: httpx.Response, tenant: str) -> None:
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and tenant in err["message"]
    assert int(resp.headers["retry-after"]) >= 1


def test_image_steps_budget(server: tuple[str, RecordingLimiter, PiperEngine]) -> None:
    url, limiter, _ = server
    images, videos = "/v1/images/generations", "/v1/videos"
    image = {"model": IMAGE, "prompt": "a fox", "size": "32x32", "n": 2, "steps": 10, "seed": 1}  # 20 steps
    # invalid requests are refused before any charge; one too big for a minute's budget never fits
    assert _post(url, "acme", images, {**image, "size": "60x64"}).status_code == 400
    resp = _post(url, "acme", images, {**image, "n": 4})  # 40 > 30 per minute
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "request_too_large"
    # a generation that fails after admission gives its 20 steps back
    assert _post(url, "acme", images, {**image, "prompt": "boom"}).status_code == 503
    assert limiter.adjusts[-1] == ("acme:image_steps", -20)
    # a video costs steps x frames: 3 x 9 = 27 of the 30, so 20 more image steps must wait
    video = {"model": VIDEO, "prompt": "waves", "size": "32x32", "num_frames": 9, "steps": 3, "seed": 2}
    assert _post(url, "acme", videos, {**video, "response_format": "frames"}).status_code == 200
    _assert_throttled(_post(url, "acme", images, image), "acme")
    _assert_throttled(_post(url, "acme", videos, video), "acme")
    # the other tenant has its own budget (27 of its 30 steps: then it is throttled too)
    assert _post(url, "other", videos, {**video, "response_format": "frames"}).status_code == 200
    _assert_throttled(_post(url, "other", images, image), "other")


def _wav_seconds(data: bytes) -> float:
    import soundfile as sf

    info = sf.info(io.BytesIO(data))
    return info.frames / info.samplerate


def test_audio_seconds_budget(server: tuple[str, RecordingLimiter, PiperEngine]) -> None:
    url, limiter, tts = server
    speech = "/v1/audio/speech"
    body = {"model": tts.model_name, "input": TEXT, "response_format": "wav"}
    estimate = len(TEXT) / 15  # modalities.tts.api.estimate_seconds
    # a synthesis that fails is refunded in full
    resp = _post(url, "acme", speech, {**body, "input": "Boom. " + TEXT})
    assert resp.status_code == 500
    assert limiter.adjusts[-1][0] == "acme:audio_seconds"
    assert limiter.adjusts[-1][1] == pytest.approx(-len("Boom. " + TEXT) / 15)
    # admission charged the estimate; the end of the stream settles it to the real duration
    resp = _post(url, "acme", speech, body)
    assert resp.status_code == 200
    seconds = _wav_seconds(resp.content)
    assert 2 < seconds < 10
    key, delta = limiter.adjusts[-1]
    assert key == "acme:audio_seconds" and delta == pytest.approx(seconds - estimate, abs=1e-3)
    # ~10 - seconds left (+ 1/6 s per second of refill): a 9.3 s estimate must wait
    long_text = {**body, "input": ("All work and no play makes a dull voice. " * 4)[:140]}
    _assert_throttled(_post(url, "acme", speech, long_text), "acme")
    _assert_throttled(_post(url, "acme", speech, {**long_text, "stream_format": "sse"}), "acme")
    resp = _post(url, "other", speech, body)
    assert resp.status_code == 200 and _wav_seconds(resp.content) > 2  # (Piper's noise varies the length)


def test_job_submissions_are_charged(server: tuple[str, RecordingLimiter, PiperEngine]) -> None:
    url, limiter, tts = server
    params = {"model": IMAGE, "prompt": "a fox", "size": "32x32", "n": 2, "steps": 10, "seed": 3}  # 20 steps
    job = {"kind": "images.generate", "params": params}
    bad = {"kind": "images.generate", "params": {**params, "size": "60x64"}}
    assert _post(url, "batch", "/v1/jobs", bad).status_code == 400  # refused before any charge
    first = _post(url, "batch", "/v1/jobs", job, **{"Idempotency-Key": "fox-1"})
    assert first.status_code == 202, first.text
    # 10 steps left: a new job waits, a replay of the first is free (and not refused)
    _assert_throttled(_post(url, "batch", "/v1/jobs", job), "batch")
    again = _post(url, "batch", "/v1/jobs", job, **{"Idempotency-Key": "fox-1"})
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    # speech jobs are charged the route's estimate: the whole text at once
    speech = {"kind": "speech.generate", "params": {"model": tts.model_name, "input": TEXT, "response_format": "wav"}}
    assert _post(url, "batch", "/v1/jobs", speech).status_code == 202
    long_speech = {"kind": "speech.generate", "params": {**speech["params"], "input": TEXT * 2}}  # ~10.1 s > 10/min
    assert _post(url, "batch", "/v1/jobs", long_speech).json()["error"]["code"] == "request_too_large"
    assert not [a for a in limiter.adjusts if a[0].startswith("batch:")]  # nothing had to be refunded
    job_url, headers = f"{url}/v1/jobs/{first.json()['id']}", {"Authorization": f"Bearer {KEYS['batch']}"}
    deadline = time.monotonic() + 60  # the charged job really runs
    while (status := httpx.get(job_url, headers=headers).json()["status"]) in ("queued", "running"):
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    assert status == "succeeded"
