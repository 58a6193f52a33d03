"""The uploaded-audio chain VAD → ASR → LLM → TTS, on real engines and real audio (a question
spoken by the Piper voice):

- local dispatch through the jobs API (``/v1/files`` + ``/v1/jobs`` kind ``audio.pipeline``);
- Celery dispatch with real ``mmserve worker`` processes (one per modality) on a real Redis
  (db 14, a unique prefix): each stage runs on its modality's worker; an injected failure of the
  LLM stage is retried alone (earlier stages ran once).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers import serve_app, serving

REDIS_URL = "redis://127.0.0.1:6379/14"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def question_wav() -> bytes:
    import soundfile as sf

    from modalities.asr.speech_corpus import synth_piper

    rate = 22_050
    (audio,) = synth_piper([QUESTION], rate)
    audio = np.concatenate([np.zeros(rate // 2, np.float32), audio, np.zeros(rate, np.float32)])
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def check_result(out: dict[str, Any], attempts: tuple[int, ...] = (1, 1, 2, 1)) -> None:
    assert "capital" in out["transcript"].lower() and "france" in out["transcript"].lower()
    assert out["segments"] and out["segments"][0]["end_ms"] > out["segments"][0]["start_ms"]
    assert "paris" in out["reply"].lower()
    stages = out["stages"]
    assert list(stages) == ["vad", "asr", "llm", "tts"]
    assert tuple(s["attempts"] for s in stages.values()) == attempts  # only a failed stage runs again
    assert all(s["seconds"] is not None and s["seconds"] >= 0 for s in stages.values())


def run_job(http: httpx.Client, wav: bytes, params: dict[str, Any], bad: tuple[str, ...] = ()) -> dict[str, Any]:
    """Upload ``wav``, check bad params are 400s (also a ``bad`` field given as "nosuch"), run an
    ``audio.pipeline`` job; its result."""
    up = http.post("/v1/files", files={"file": ("q.wav", wav, "audio/wav")}, data={"purpose": "user_data"})
    assert up.status_code == 200, up.text
    params = {"file_id": up.json()["id"], **params}
    wrong = [({**params, field: "nosuch"}, field) for field in bad]
    for bad_params, field in (
        ({**params, "max_tokens": 0}, "max_tokens"),
        ({**params, "nope": 1}, "nope"),
        ({}, "file_id"),
        ({**params, "respond": False, "speak": True}, "speak"),  # (the TTS speaks the LLM's reply)
        *wrong,
    ):
        resp = http.post("/v1/jobs", json={"kind": "audio.pipeline", "params": bad_params})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == f"params.{field}", resp.text
    resp = http.post("/v1/jobs", json={"kind": "audio.pipeline", "params": params})
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    deadline = time.monotonic() + 120
    while (job := http.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    assert job["status"] == "succeeded", job
    progress = job["progress"]  # stages done of the chain's, and each one's timing
    assert (progress["step"], progress["total"], progress["detail"]["stage"]) == (4, 4, None)
    assert all(s["seconds"] > 0 and s["attempts"] >= 1 for s in progress["detail"]["stages"].values())
    out = job["result"]
    wav_out = http.get(out["files"]["audio"])
    assert wav_out.status_code == 200
    import soundfile as sf

    audio, rate = sf.read(io.BytesIO(wav_out.content))
    assert rate == 24_000 and len(audio) / rate > 0.3
    return out


def test_local_dispatch_through_the_jobs_api(
    question_wav: bytes, smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from gateway.app import create_app
    from modalities.asr.engine import AsrConfig, AsrEngine
    from modalities.tts.piper_engine import PiperEngine
    from pipelines.plugin import router as pipelines_router
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobsConfig, JobService

    llm = AsyncEngine.from_config(EngineConfig(model=str(smollm2_dir)))
    asr = AsrEngine.from_config(AsrConfig(max_num_seqs=4))
    tts = PiperEngine(workers=1)
    app = create_app(
        {"smollm2": llm, asr.model_name: asr, tts.model_name: tts}, routers=[jobs_router, pipelines_router]
    )
    app.state.jobs = JobService(JobsConfig(store={"type": "local", "root": str(tmp_path)}), app.state.engines)
    with serve_app(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        params = {"max_tokens": 24, "fail_once": ["llm"], "llm": "smollm2", "voice": "alloy"}
        monkeypatch.delenv("MMSERVE_FAULT_INJECTION", raising=False)
        refused = http.post("/v1/jobs", json={"kind": "audio.pipeline", "params": {"file_id": "file-x", **params}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "params.fail_once"
        monkeypatch.setenv("MMSERVE_FAULT_INJECTION", "1")  # (a drill: the LLM stage's first attempt fails)
        out = run_job(http, question_wav, params, bad=("llm", "asr", "tts", "voice"))
        check_result(out)
        assert all(s["worker"] == "local" for s in out["stages"].values())


@pytest.fixture(scope="module")
def cluster(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One ``mmserve worker`` process per modality on db 14 under a fresh prefix."""
    import redis

    redis.Redis.from_url(REDIS_URL).ping()
    prefix = f"h8test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    common = [
        "--redis-url",
        REDIS_URL,
        "--prefix",
        prefix,
        "--allow-root",
        "--concurrency",
        "4",
        "--log-level",
        "warning",
    ]
    extra = {"asr": [], "llm": ["--llm", str(smollm2_dir)], "tts": ["--tts-workers", "1"]}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "worker", "--modality", m, *common, *args],
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
        for m, args in extra.items()
    ]
    from gateway.app import create_app
    from pipelines.plugin import router as pipelines_router  # registers the audio.pipeline job kind
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobsConfig, JobService

    app = create_app({}, routers=[jobs_router, pipelines_router])
    cfg = JobsConfig(
        dispatch="celery",
        redis_url=REDIS_URL,
        key_prefix=f"{prefix}:jobs",
        queue_prefix=prefix,
        store={"type": "local", "root": str(tmp_path_factory.mktemp("results"))},
    )
    app.state.jobs = JobService(cfg, serving("asr"))  # (the ASR workers run the jobs)
    try:
        with serve_app(app) as base:
            yield {"prefix": prefix, "base": base}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        r = redis.Redis.from_url(REDIS_URL)
        for key in r.scan_iter(f"{prefix}*"):
            r.delete(key)


def _send_chain(
    cluster: dict[str, str], audio: np.ndarray, opts: Any, keep_result: bool = True
) -> tuple[Any, str, Any]:
    """``audio``'s chain with ``opts`` stored and sent through Celery to the cluster's workers:
    ``(its StageStore, its id, the chain's AsyncResult)``."""
    from pipelines.chain import celery_chain
    from pipelines.stage_store import StageStore
    from workers.celery_app import make_celery

    app = make_celery(REDIS_URL, socket_timeout_s=10)  # a loaded test machine can be slow to answer
    store = StageStore(REDIS_URL, cluster["prefix"])
    chain_id = uuid.uuid4().hex
    store.create(chain_id, audio, opts)
    return store, chain_id, celery_chain(app, chain_id, opts, cluster["prefix"], keep_result=keep_result).apply_async()


def test_celery_chain_runs_each_stage_on_its_modality_worker(question_wav: bytes, cluster: dict[str, str]) -> None:
    from modalities.audio import decode_audio
    from pipelines.chain import result
    from pipelines.stage_store import ChainOptions

    opts = ChainOptions(max_tokens=24, fail_once=["llm"])
    store, chain_id, async_result = _send_chain(cluster, decode_audio(question_wav).samples, opts)
    assert async_result.id  # the chain's id, before any stage ran
    assert store.status(chain_id)["status"] == "queued"
    deadline = time.monotonic() + 120
    while (status := store.status(chain_id))["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    assert status["status"] == "succeeded", status
    out = result(store, chain_id)
    out["stages"] = out.pop("status")["stages"]
    check_result(out)
    check_workers(out["stages"])
    assert out["audio"].size / out["sample_rate"] > 0.3
    final = async_result.get(timeout=30)  # the last task's return value: the result without audio
    assert final["reply"] == out["reply"] and "audio" not in final


def test_a_chain_whose_stage_fails_for_good_fails_its_async_result(
    question_wav: bytes, cluster: dict[str, str]
) -> None:
    """Sent as a direct Celery user would, the chain's ``AsyncResult.get()`` raises its stage's
    failure; sent as a job's follower sends it (``keep_result=False``: the job has the outcome),
    no task of the chain leaves a ``celery-task-meta`` key in Redis, a stage that ran included."""
    import redis

    from modalities.audio import decode_audio
    from pipelines.stage_store import ChainOptions

    opts = ChainOptions(max_tokens=8, fail_once=["asr"], max_attempts=1)
    audio = decode_audio(question_wav).samples
    store, chain_id, async_result = _send_chain(cluster, audio, opts)
    with pytest.raises(Exception, match="injected failure of stage 'asr'"):
        async_result.get(timeout=60)
    assert store.status(chain_id)["status"] == "failed"
    store, chain_id, async_result = _send_chain(cluster, audio, opts, keep_result=False)
    deadline = time.monotonic() + 60
    while store.status(chain_id)["status"] != "failed":
        assert time.monotonic() < deadline, store.status(chain_id)
        time.sleep(0.1)
    ids, r = [], async_result
    while r is not None:
        ids.append(r.id)
        r = r.parent
    assert len(ids) == 4 and store.status(chain_id)["stages"]["vad"]["attempts"] == 1
    time.sleep(0.5)  # (a result would be stored as its task ends, before the next one starts)
    assert redis.Redis.from_url(REDIS_URL).exists(*(f"celery-task-meta-{i}" for i in ids)) == 0


def test_a_cancelled_chains_running_stage_stops_on_its_worker(cluster: dict[str, str]) -> None:
    """A chain cancelled while its LLM stage decodes (its job was cancelled) stops that decode on
    the LLM worker within a moment, stores no reply, and runs no later stage."""
    from modalities.asr.speech_corpus import synth_piper
    from modalities.audio import ASR_RATE
    from pipelines.stage_store import ChainOptions

    (ask,) = synth_piper(["Tell me a very long story about a brave knight and a dragon."], ASR_RATE)
    opts = ChainOptions(max_tokens=1024, speak=False)  # (a story SmolLM2 tells for 1024 tokens)
    audio = np.concatenate([np.zeros(ASR_RATE // 2, np.float32), ask])
    store, chain_id, async_result = _send_chain(cluster, audio, opts)
    deadline = time.monotonic() + 120
    while store.attempts(chain_id, "llm") == 0:
        assert time.monotonic() < deadline and store.status(chain_id)["status"] not in ("succeeded", "failed")
        time.sleep(0.05)

    def decoding(beat: dict[str, Any]) -> bool:
        return beat.get("inflight", 0) >= 1 and any(s.get("num_running", 0) for s in beat.get("stats", {}).values())

    beat = worker_beat(cluster, store.status(chain_id)["stages"]["llm"]["worker"], decoding)
    assert decoding(beat)  # (the stage counts as the LLM worker's work in its heartbeat)
    store.set_status(chain_id, "cancelled")  # what the job's follower does when the job is cancelled
    cancelled = time.monotonic()
    assert async_result.get(timeout=60) is None  # the LLM stage's task (the last): ended, without a result
    assert time.monotonic() - cancelled < 5.0  # (1024 tokens on one thread take far longer)
    assert store.output(chain_id, "llm") is None and store.status(chain_id)["status"] == "cancelled"


def worker_beat(cluster: dict[str, str], worker: str, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first heartbeat of ``worker`` that is ``ok`` within 5 s (else the last one seen)."""
    import redis

    from workers.wire import Keys

    r, deadline = redis.Redis.from_url(REDIS_URL), time.monotonic() + 5
    while (
        not ok(beat := json.loads(r.get(Keys(cluster["prefix"]).worker(worker)) or "{}"))
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return beat


def test_more_pipeline_jobs_than_the_asr_workers_threads_all_finish(
    question_wav: bytes, cluster: dict[str, str]
) -> None:
    """Four ``audio.pipeline`` jobs at once on an ASR worker of four threads: their followers
    take at most half of them, so the VAD and ASR stage tasks they send find a thread (with a
    follower on every thread, no stage could ever run)."""
    with httpx.Client(base_url=cluster["base"], timeout=30) as http:
        up = http.post("/v1/files", files={"file": ("q.wav", question_wav, "audio/wav")}, data={"purpose": "user_data"})
        params = {"file_id": up.json()["id"], "max_tokens": 8, "speak": False}
        ids = [http.post("/v1/jobs", json={"kind": "audio.pipeline", "params": params}).json()["id"] for _ in range(4)]
        # (126 s on a slow Skylake VM, at this commit and at the one before: 150 s was close)
        deadline = time.monotonic() + 300
        while (states := [http.get(f"/v1/jobs/{i}").json()["status"] for i in ids]) != ["succeeded"] * 4:
            assert time.monotonic() < deadline and "failed" not in states, states
            time.sleep(0.5)


def check_workers(stages: dict[str, Any]) -> None:
    workers = {name: s["worker"] for name, s in stages.items()}
    assert workers["vad"].startswith("asr-") and workers["asr"].startswith("asr-")
    assert workers["llm"].startswith("llm-") and workers["tts"].startswith("tts-")


def test_celery_dispatch_through_the_jobs_api(question_wav: bytes, cluster: dict[str, str]) -> None:
    with httpx.Client(base_url=cluster["base"], timeout=30) as http:
        out = run_job(http, question_wav, {"max_tokens": 24})
    check_result(out, attempts=(1, 1, 1, 1))
    check_workers(out["stages"])


def test_celery_logs_no_result_of_an_mmserve_task(caplog: pytest.LogCaptureFixture) -> None:
    """``mmserve worker``'s log: Celery's success line of a chain's last stage task leaves out its
    return value (the transcript and reply); other tasks' lines are Celery's own."""
    import logging

    from celery.app import trace

    from pipelines.tasks import TASK_NAME
    from workers.worker import hide_task_results

    hide_task_results()
    with caplog.at_level(logging.INFO, logger="celery.app.trace"):
        for name, value in ((TASK_NAME, "{'reply': 'Paris is the capital'}"), ("other.task", "42")):
            line = {"id": "t", "name": name, "return_value": value, "runtime": 0.1, "args": "()", "kwargs": "{}"}
            trace.info(trace.LOG_SUCCESS, line)
    assert "Paris" not in caplog.text and "(not logged)" in caplog.text and "succeeded in 0.1s: 42" in caplog.text
