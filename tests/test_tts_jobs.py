"""``speech.generate`` jobs under the local runner over real HTTP: text longer than the online
limit becomes one audio file in the result store, with progress; bad params are 400 at submit.
Uses the tiny AR TTS (fast) next to the Piper voice (routing by voice); a text the voice makes
no audio of fails the job as the route refuses it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from modalities.audio import decode_audio
from modalities.tts.protocol import MAX_INPUT_CHARS
from modalities.tts.tiny import tiny_tts_ar_dir
from tests.helpers import serve_app

FRAMES = 6
SAMPLES_PER_PIECE = FRAMES * 320 - 8  # the tiny DAC trims 8 samples at the end of each piece


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from gateway.app import create_app
    from modalities.tts import plugin  # registers the job kind
    from modalities.tts.ar_engine import ARTTSEngine
    from modalities.tts.piper_engine import PiperEngine
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobsConfig, JobService

    ar = ARTTSEngine.from_dir(tiny_tts_ar_dir(), num_kv_blocks=128, max_frames=FRAMES, decode_every=4)
    piper = PiperEngine(workers=1, threads=1)
    aliases = {"voice-ar": ar.model_name}
    app = create_app(
        {ar.model_name: ar, piper.model_name: piper}, aliases=aliases, routers=[plugin.router, jobs_router]
    )
    root = tmp_path_factory.mktemp("results")
    app.state.jobs = JobService(
        JobsConfig(store={"type": "local", "root": str(root)}), app.state.engines, app.state.aliases
    )
    with serve_app(app) as url:
        yield url


def _wait(base: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=30).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish: {job}")


def test_long_text_job_writes_one_audio_file_with_progress(base: str) -> None:
    from modalities.tts.jobs import segments
    from modalities.tts.text import split_text

    sentence = "This is sentence number {} of a long chapter, and it goes on with more words until it is long."
    text = " ".join(sentence.format(i) for i in range(45))
    assert len(text) > MAX_INPUT_CHARS
    resp = httpx.post(
        f"{base}/v1/jobs",
        json={"kind": "speech.generate", "params": {"input": text, "voice": "tiny-a", "response_format": "wav"}},
        timeout=30,
    )
    assert resp.status_code == 202, resp.text
    job = _wait(base, resp.json()["id"])
    assert job["status"] == "succeeded", job
    result = job["result"]
    fetched = httpx.get(f"{base}{result['url']}", timeout=30)
    recorded = next(f["content_type"] for f in job["files"] if f["url"] == result["url"])
    assert fetched.headers["content-type"] == recorded == "audio/wav"  # (not the platform's guess, audio/x-wav)
    audio = decode_audio(fetched.content, rate=None)
    pieces = sum(len(split_text(s)) for s in segments(text))
    assert audio.rate == 24000
    # each piece stops at <|audio_end|> or after FRAMES frames (the random model sometimes ends early)
    assert pieces * SAMPLES_PER_PIECE * 0.5 < len(audio.samples) <= pieces * SAMPLES_PER_PIECE
    assert result["seconds"] == pytest.approx(audio.duration)
    with httpx.stream("GET", f"{base}/v1/jobs/{job['id']}/events", timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [(e["step"], e["total"]) for e in events if "step" in e]
    assert len(progress) == len(segments(text)) >= 5
    assert [p[0] for p in progress] == sorted(p[0] for p in progress) and progress[-1][0] == progress[-1][1]


@pytest.mark.parametrize(
    ("params", "needle", "param"),
    [
        ({"input": ""}, "non-empty", "params.input"),
        ({"input": "x" * 200_001}, "maximum", "params.input"),
        ({"input": "hi", "voice": "nobody"}, "nobody", "params.voice"),  # (resolved as the route resolves it)
        ({"input": "hi", "voice": "tiny-a", "speed": 9.0}, "speed", "params.speed"),
        ({"input": "hi", "response_format": "midi"}, "response_format", "params.response_format"),
        ({"input": 5}, "string", "params.input"),
    ],
)
def test_bad_job_params_are_400_at_submit(base: str, params: dict[str, Any], needle: str, param: str) -> None:
    resp = httpx.post(f"{base}/v1/jobs", json={"kind": "speech.generate", "params": params}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"] and resp.json()["error"]["param"] == param


@pytest.mark.parametrize("text", ["...", "\u200b"])
def test_text_the_voice_makes_no_audio_of_fails_the_job(base: str, text: str) -> None:
    """Piper speaks nothing of lone punctuation or a zero-width space (the route's 400), where the
    AR voice speaks something: only the voice knows, so the job is queued, then fails with the
    route's message rather than succeed with an empty file."""
    online = httpx.post(f"{base}/v1/audio/speech", json={"input": text, "voice": "joe"}, timeout=60)
    assert online.status_code == 400 and online.json()["error"]["param"] == "input", online.text
    assert httpx.post(f"{base}/v1/audio/speech", json={"input": text, "voice": "tiny-a"}, timeout=60).content
    resp = httpx.post(f"{base}/v1/jobs", json={"kind": "speech.generate", "params": {"input": text, "voice": "joe"}})
    assert resp.status_code == 202, resp.text
    job = _wait(base, resp.json()["id"])
    assert job["status"] == "failed" and online.json()["error"]["message"] in job["error"]["message"], job
    assert not job["files"]


def test_a_job_names_its_model_as_the_route_does(base: str) -> None:
    """An alias resolves at submit as on ``/v1/audio/speech``; the stored params name the served
    model (a worker knows no aliases), and the job runs on it."""
    params = {"input": "Hi there.", "model": "voice-ar", "voice": "tiny-a", "response_format": "wav"}
    route = httpx.post(f"{base}/v1/audio/speech", json=params, timeout=60)
    assert route.status_code == 200, route.text
    resp = httpx.post(f"{base}/v1/jobs", json={"kind": "speech.generate", "params": params}, timeout=30)
    assert resp.status_code == 202, resp.text
    assert resp.json()["params"]["model"] == route.headers["x-model"] != "voice-ar"
    job = _wait(base, resp.json()["id"])
    assert job["status"] == "succeeded" and job["result"]["model"] == route.headers["x-model"], job


def test_plugin_registers_the_kind() -> None:
    from workers.jobs import get_job_kind

    kind = get_job_kind("speech.generate")
    assert kind is not None and kind.modality == "tts"
