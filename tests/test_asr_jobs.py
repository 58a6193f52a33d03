"""``audio.transcription`` jobs under the local runner over real HTTP: an audio file uploaded with
``/v1/files`` becomes a transcript file in the result store; bad params are a 400 at submit."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from modalities.asr.speech_corpus import SENTENCES, long_recording
from modalities.audio import encode_audio
from tests.helpers import serve_app


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from gateway.app import create_app
    from modalities.asr import plugin  # registers the job kind
    from modalities.asr.engine import AsrConfig, AsrEngine
    from modalities.asr.model import load_whisper
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobsConfig, JobService

    engine = AsrEngine(load_whisper("tiny.en"), AsrConfig())
    app = create_app({engine.model_name: engine}, routers=[plugin.router, jobs_router])
    root = tmp_path_factory.mktemp("results")
    app.state.jobs = JobService(JobsConfig(store={"type": "local", "root": str(root)}), app.state.engines)
    with serve_app(app) as url:
        yield url


def _wait(base: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=30).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish: {job}")


def test_uploaded_audio_becomes_a_transcript_file(base: str) -> None:
    audio, bounds = long_recording("piper", gap_s=1.0, sentences=[2, 4, 8])
    up = httpx.post(
        f"{base}/v1/files",
        files={"file": ("talk.flac", encode_audio(audio, 16_000, "flac"))},
        data={"purpose": "user_data"},
        timeout=30,
    )
    assert up.status_code == 200, up.text
    resp = httpx.post(
        f"{base}/v1/jobs",
        json={"kind": "audio.transcription", "params": {"file_id": up.json()["id"], "response_format": "srt"}},
        timeout=30,
    )
    assert resp.status_code == 202, resp.text
    job = _wait(base, resp.json()["id"])
    assert job["status"] == "succeeded", job
    result = job["result"]
    words = re.sub(r"[^\w' ]", " ", result["text"].lower()).split()
    assert words == re.sub(r"[^\w' ]", " ", " ".join(SENTENCES[i] for i in (2, 4, 8)).lower()).split()
    srt = httpx.get(f"{base}{result['url']}", timeout=30).text
    assert srt.startswith("1\n00:00:0") and result["text"].split()[0] in srt
    assert result["duration"] == pytest.approx(len(audio) / 16_000)


def test_bad_params_are_400(base: str) -> None:
    bad = (
        {},
        {"file_id": "x", "temperature": 3},
        {"file_id": "x", "response_format": "xml"},
        {"file_id": "x", "seed": -1},
    )
    for params in bad:
        r = httpx.post(f"{base}/v1/jobs", json={"kind": "audio.transcription", "params": params}, timeout=30)
        assert r.status_code == 400, (params, r.text)
