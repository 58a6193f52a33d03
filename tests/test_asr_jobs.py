"""``audio.transcription`` jobs under the local runner over real HTTP: an audio file uploaded with
``/v1/files`` becomes a transcript file in the result store, with OpenAI's ``words`` when
``timestamp_granularities`` has ``word``; bad params are a 400 at submit."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
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
    aliases = {"whisper-1": engine.model_name}
    app = create_app({engine.model_name: engine}, aliases=aliases, routers=[plugin.router, jobs_router])
    root = tmp_path_factory.mktemp("results")
    cfg = JobsConfig(store={"type": "local", "root": str(root)})
    app.state.jobs = JobService(cfg, app.state.engines, app.state.aliases)
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


def _upload(base: str, audio: np.ndarray) -> str:
    up = httpx.post(
        f"{base}/v1/files",
        files={"file": ("talk.flac", encode_audio(audio, 16_000, "flac"))},
        data={"purpose": "user_data"},
        timeout=30,
    )
    assert up.status_code == 200, up.text
    return str(up.json()["id"])


def _transcribe(base: str, params: dict[str, Any]) -> dict[str, Any]:
    """The succeeded job's result."""
    resp = httpx.post(f"{base}/v1/jobs", json={"kind": "audio.transcription", "params": params}, timeout=30)
    assert resp.status_code == 202, resp.text
    job = _wait(base, resp.json()["id"])
    assert job["status"] == "succeeded", job
    return dict(job["result"])


def test_uploaded_audio_becomes_a_transcript_file(base: str) -> None:
    audio, bounds = long_recording("piper", gap_s=1.0, sentences=[2, 4, 8])
    result = _transcribe(base, {"file_id": _upload(base, audio), "response_format": "srt", "include": None})
    assert "words" not in result  # not asked for
    words = re.sub(r"[^\w' ]", " ", result["text"].lower()).split()
    assert words == re.sub(r"[^\w' ]", " ", " ".join(SENTENCES[i] for i in (2, 4, 8)).lower()).split()
    srt = httpx.get(f"{base}{result['url']}", timeout=30).text
    assert srt.startswith("1\n00:00:0") and result["text"].split()[0] in srt
    assert result["duration"] == pytest.approx(len(audio) / 16_000)


def test_word_granularity_puts_words_in_the_transcript(base: str) -> None:
    """``timestamp_granularities: ["word"]`` as on ``/v1/audio/transcriptions``: the verbose_json
    transcript has OpenAI's ``words`` (no punctuation, times monotonic and inside the audio) and
    no ``segments``; the result counts the words."""
    audio, _ = long_recording("piper", gap_s=1.0, sentences=[0, 2, 10])
    file_id = _upload(base, audio)
    result = _transcribe(base, {"file_id": file_id, "timestamp_granularities": ["word"]})
    body = httpx.get(f"{base}{result['url']}", timeout=30).json()
    assert body["text"] == result["text"] and "segments" not in body
    assert "." in body["text"] and "?" in body["text"]  # the text keeps its punctuation
    words = body["words"]
    assert result["words"] == len(words) and all(set(w) == {"word", "start", "end"} for w in words)
    assert [w["word"] for w in words] == re.sub(r"[^\w' ]", " ", result["text"]).split()  # "dog." -> "dog"
    assert all(a["start"] <= a["end"] <= b["start"] for a, b in zip(words, words[1:], strict=False))
    assert 0.0 <= words[0]["start"] and words[-1]["end"] <= len(audio) / 16_000
    both = _transcribe(base, {"file_id": file_id, "timestamp_granularities": ["segment", "word"]})
    body = httpx.get(f"{base}{both['url']}", timeout=30).json()
    assert body["words"] == words and body["segments"] and both["segments"] == len(body["segments"])


def test_logprobs_in_the_json_transcript(base: str) -> None:
    audio, _ = long_recording("piper", gap_s=1.0, sentences=[1])
    params = {"file_id": _upload(base, audio), "response_format": "json", "include": ["logprobs"]}
    result = _transcribe(base, {**params, "timestamp_granularities": None})  # (null: as left out)
    body = httpx.get(f"{base}{result['url']}", timeout=30).json()
    assert body["text"] == result["text"] and body["usage"]["type"] == "duration"
    assert "".join(lp["token"] for lp in body["logprobs"]).strip() == body["text"]
    assert all(lp["logprob"] <= 0 and bytes(lp["bytes"]).decode() == lp["token"] for lp in body["logprobs"])


def test_bad_params_are_400(base: str) -> None:
    bad = (
        {},
        {"file_id": "x", "temperature": 3},
        {"file_id": "x", "response_format": "xml"},
        {"file_id": "x", "seed": -1},
        {"file_id": "x", "timestamp_granularities": "word"},  # a list, as the JSON body has it
        {"file_id": "x", "temperature": True},  # (not 1.0: a number, as the speech body's)
        {"file_id": "x", "seed": False},
    )
    for params in bad:
        r = httpx.post(f"{base}/v1/jobs", json={"kind": "audio.transcription", "params": params}, timeout=30)
        assert r.status_code == 400, (params, r.text)
        field = next(iter(set(params) - {"file_id"}), "file_id")  # (the one field that is wrong)
        assert r.json()["error"]["param"] == f"params.{field}", r.text
        if isinstance(params.get(field), bool):
            assert "not a boolean" in r.json()["error"]["message"], r.text
    # The endpoint's granularity rules, with the endpoint's messages.
    granularities = (
        ({"timestamp_granularities": ["phrase"]}, "must be 'segment' or 'word' (got 'phrase')"),
        ({"timestamp_granularities": ["word"], "response_format": "srt"}, "requires response_format=verbose_json"),
        ({"timestamp_granularities": ["segment"], "response_format": "json"}, "requires response_format=verbose_json"),
    )
    includes = (
        ({"include": ["tokens"]}, "may only hold 'logprobs'"),
        ({"include": ["logprobs"]}, "requires response_format=json"),  # (the job's default: verbose_json)
        ({"include": ["logprobs"], "response_format": "json", "task": "translate"}, "translate task has no include"),
    )
    for params, message in granularities:
        r = httpx.post(
            f"{base}/v1/jobs", json={"kind": "audio.transcription", "params": {"file_id": "x", **params}}, timeout=30
        )
        assert r.status_code == 400, (params, r.text)
        error = r.json()["error"]
        assert error["message"].startswith("params.timestamp_granularities: ") and message in error["message"]
        assert error["param"] == "params.timestamp_granularities"  # (the field, as OpenAI's errors name it)
    for params, message in includes:
        r = httpx.post(
            f"{base}/v1/jobs", json={"kind": "audio.transcription", "params": {"file_id": "x", **params}}, timeout=30
        )
        assert r.status_code == 400 and message in r.json()["error"]["message"], (params, r.text)
        assert r.json()["error"]["param"] == "params.include"


def test_model_language_and_task_are_checked_at_submit(base: str) -> None:
    """As the online routes answer them: an unknown model is a 404, a language or the translate
    task the English-only model cannot do a 400, each with the route's message and its field
    inside params; a good submission stores the served model's name for the worker."""
    wav = encode_audio(np.zeros(16_000, np.float32), 16_000, "wav")
    route = {
        "language": httpx.post(
            f"{base}/v1/audio/transcriptions", files={"file": ("a.wav", wav)}, data={"language": "de"}, timeout=60
        ),
        "long": httpx.post(
            f"{base}/v1/audio/transcriptions", files={"file": ("a.wav", wav)}, data={"language": "x" * 1000}, timeout=60
        ),
        "model": httpx.post(
            f"{base}/v1/audio/transcriptions", files={"file": ("a.wav", wav)}, data={"model": "nope"}, timeout=60
        ),
        "translate": httpx.post(f"{base}/v1/audio/translations", files={"file": ("a.wav", wav)}, timeout=60),
    }
    cases = {
        "language": {"language": "de"},
        "long": {"language": "x" * 1000},
        "model": {"model": "nope"},
        "translate": {"task": "translate"},
    }
    for case, params in cases.items():
        r = httpx.post(
            f"{base}/v1/jobs", json={"kind": "audio.transcription", "params": {"file_id": "x", **params}}, timeout=30
        )
        online = route[case]
        assert r.status_code == online.status_code and online.status_code in (400, 404), (case, r.text, online.text)
        error, expected = r.json()["error"], online.json()["error"]
        assert error["message"] == expected["message"] and error["code"] == expected["code"], (case, r.text)
        assert error["param"] == f"params.{expected['param']}", (case, r.text)
    params = {"file_id": _upload(base, np.zeros(16_000, np.float32)), "model": "whisper-1", "language": "EN"}
    job = httpx.post(f"{base}/v1/jobs", json={"kind": "audio.transcription", "params": params}, timeout=30)
    assert job.status_code == 202 and job.json()["params"]["model"] == "whisper-tiny.en", job.text
    assert _wait(base, job.json()["id"])["status"] == "succeeded"


def test_validate_resolves_the_model_among_remote_engines() -> None:
    """Under celery the gateway's engines are proxies: the model resolves by name as locally (a
    non-ASR model is a 400), and a language no Whisper takes is refused without asking a worker."""
    from gateway.errors import APIError
    from modalities.asr.jobs import validate
    from workers.remote import RemoteEngine

    engines = {"whisper-tiny.en": RemoteEngine(None, "whisper-tiny.en", "asr"), "tts": RemoteEngine(None, "tts", "tts")}
    aliases = {"whisper-1": "whisper-tiny.en"}
    params = validate({"file_id": "x", "model": "whisper-1", "language": "de"}, engines, aliases)
    assert params["model"] == "whisper-tiny.en"  # (an English-only worker refuses "de" as it runs)
    with pytest.raises(APIError) as other:
        validate({"file_id": "x", "model": "tts"}, engines, aliases)
    assert other.value.status_code == 400 and other.value.param == "model" and "transcription" in other.value.message
    with pytest.raises(APIError) as unknown:
        validate({"file_id": "x", "language": "x" * 1000}, engines, aliases)
    assert unknown.value.status_code == 400 and unknown.value.param == "language"


def test_too_short_audio_fails_the_job_as_the_route_refuses_it(base: str) -> None:
    """10 ms of audio: the online route's 400 ``audio_too_short``; a job fails with its error
    object (message, type, code) rather than succeed with an empty transcript."""
    short = np.zeros(160, np.float32)
    online = httpx.post(
        f"{base}/v1/audio/transcriptions", files={"file": ("s.wav", encode_audio(short, 16_000, "wav"))}, timeout=60
    )
    assert online.status_code == 400 and online.json()["error"]["code"] == "audio_too_short", online.text
    resp = httpx.post(
        f"{base}/v1/jobs",
        json={"kind": "audio.transcription", "params": {"file_id": _upload(base, short)}},
        timeout=30,
    )
    assert resp.status_code == 202, resp.text
    job = _wait(base, resp.json()["id"])
    assert job["status"] == "failed" and job["error"] == online.json()["error"], job  # the route's error object
