"""Regressions from the jobs review, over real HTTP (uvicorn) and a real Redis (db 13, a unique
prefix): idempotent replays do not grow the queued count, files are tenant-private in jobs and
generated images, batch kinds only go through /v1/batches, batches and audio jobs are charged
against the tenant's rate limits, and a job WebSocket closed by its client stops following events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets.sync.client
from fastapi import APIRouter, Request

import tests.test_jobs_kinds  # noqa: F401 - registers the test.steps kind
from tests.helpers import redis_reachable, serve_app, serving

REDIS_URL = "redis://127.0.0.1:6379/13"
KEYS = {"alice": "alice-key", "bob": "bob-key"}
BOB_LIMITS = {"embed_inputs": 3, "audio_seconds": 1}


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.mark.skipif(not redis_reachable(REDIS_URL), reason="needs the Redis server on 127.0.0.1:6379")
def test_idempotent_replays_leave_the_queued_count_alone() -> None:
    from workers.jobs.redis_backend import RedisBackend
    from workers.jobs.state import new_id, new_record

    prefix = f"review{uuid.uuid4().hex[:8]}:jobs"

    async def scenario() -> tuple[int, int, set[str]]:
        backend = RedisBackend(REDIS_URL, prefix)
        try:
            ids = set()
            for _ in range(21):  # the first creates, 20 replays
                rec = new_record(new_id("job"), "test.steps", "embed", {}, max_attempts=1, idempotency_key="k1")
                stored, _ = await backend.create(rec)
                ids.add(stored["id"])
            other = new_record(new_id("job"), "test.steps", "embed", {}, max_attempts=1, idempotency_key="k2")
            await backend.create(other)
            return await backend.queued_count(), len(await backend.r.keys(f"{prefix}:job:*")), ids
        finally:
            for key in await backend.r.keys(f"{prefix}:*"):
                await backend.r.delete(key)
            await backend.close()

    queued, records, ids = asyncio.run(scenario())
    assert len(ids) == 1  # every replay answered the first job
    assert queued == 2 and records == 2


class _EventsWatch:
    """Counts the job event streams being followed right now (the WS handler's loop)."""

    def __init__(self, backend: Any) -> None:
        self.inner, self.active = backend.events, 0

    async def __call__(self, job_id: str, after: str | None = None) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        self.active += 1
        try:
            async for item in self.inner(job_id, after):
                yield item
        finally:
            self.active -= 1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, _EventsWatch]]:
    import pipelines.plugin  # noqa: F401 - registers audio.pipeline
    from gateway.app import create_app
    from gateway.auth import KeyStore, hash_key
    from modalities.asr import jobs as asr_jobs
    from modalities.diffusion.api import _store_file
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobsConfig, JobService

    asr_jobs.register()
    keys = KeyStore()
    keys.add_tenant("alice", [hash_key(KEYS["alice"])])
    keys.add_tenant("bob", [hash_key(KEYS["bob"])], BOB_LIMITS)
    extra = APIRouter()

    @extra.post("/test/generated")
    async def generated(request: Request) -> dict[str, str]:
        """What the image routes do with ``response_format=url``: keep the PNG as a file."""
        return {"url": await _store_file(request, b"\x89PNG fake", "image.png", "image/png")}

    # An ASR model by name only: audio.transcription resolves its model at submit; the jobs here
    # fail before they decode. An embedding one too: batches of /v1/embeddings and the embed test
    # kinds are accepted only where that modality is served.
    app = create_app(serving("asr", "embed"), keys=keys, routers=[jobs_router, extra])
    root = tmp_path_factory.mktemp("results")
    app.state.jobs = JobService(JobsConfig(store={"type": "local", "root": str(root)}), app.state.engines)
    watch = _EventsWatch(app.state.jobs.backend)
    app.state.jobs.backend.events = watch
    with serve_app(app) as url:
        yield url, watch


def _upload(url: str, tenant: str, data: bytes, name: str, purpose: str = "user_data") -> str:
    resp = httpx.post(
        f"{url}/v1/files", headers=_auth(tenant), files={"file": (name, data)}, data={"purpose": purpose}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _post(url: str, tenant: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", headers=_auth(tenant), json=body, timeout=30)


def test_jobs_read_only_the_callers_files(server: tuple[str, _EventsWatch]) -> None:
    url, _ = server
    fid = _upload(url, "alice", b"RIFF" + bytes(3000), "a.wav")
    for kind in ("audio.transcription", "audio.pipeline"):
        resp = _post(url, "bob", "/v1/jobs", {"kind": kind, "params": {"file_id": fid}})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found", resp.text
        assert resp.json()["error"]["param"] == "params.file_id"  # as the other bad params are named
    batch = {"input_file_id": fid, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    resp = _post(url, "bob", "/v1/batches", batch)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "input_file_id", resp.text
    # the owner may (the job then fails here: the stand-in ASR decodes nothing)
    assert (
        _post(url, "alice", "/v1/jobs", {"kind": "audio.transcription", "params": {"file_id": fid}}).status_code == 202
    )


def test_generated_files_are_tenant_private(server: tuple[str, _EventsWatch]) -> None:
    url, _ = server
    content = httpx.post(f"{url}/test/generated", headers=_auth("alice"), timeout=30).json()["url"]
    assert httpx.get(content, headers=_auth("alice"), timeout=30).content == b"\x89PNG fake"
    resp = httpx.get(content, headers=_auth("bob"), timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_batch_kinds_only_through_batches(server: tuple[str, _EventsWatch]) -> None:
    url, _ = server
    fid = _upload(url, "alice", b'{"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}}\n', "b.jsonl")
    params = {"input_file_id": fid, "endpoint": "/v1/embeddings", "completion_window": "24h", "total": 1}
    resp = _post(url, "alice", "/v1/jobs", {"kind": "batch:/v1/embeddings", "params": params})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kind", resp.text


def test_batches_and_audio_jobs_are_charged(server: tuple[str, _EventsWatch]) -> None:
    url, _ = server
    lines = [{"custom_id": f"r{i}", "url": "/v1/embeddings", "body": {"input": ["a", "b"]}} for i in range(2)]
    fid = _upload(url, "bob", "\n".join(json.dumps(x) for x in lines).encode(), "in.jsonl", "batch")
    body = {"input_file_id": fid, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    resp = _post(url, "bob", "/v1/batches", body)  # 4 inputs, bob may embed 3 a minute
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == "request_too_large" and "embed_inputs" in resp.json()["error"]["message"]
    # audio jobs: ~2 s of 16 kHz 16-bit audio by its size, bob may send 1 s a minute
    audio = _upload(url, "bob", bytes(64_000), "long.wav")
    for kind in ("audio.transcription", "audio.pipeline"):
        resp = _post(url, "bob", "/v1/jobs", {"kind": kind, "params": {"file_id": audio}})
        assert resp.status_code == 429 and "audio_seconds" in resp.json()["error"]["message"], resp.text


def test_batch_cost_counts_inputs_and_tokens() -> None:
    from workers.jobs.batch import DEFAULT_MAX_TOKENS, batch_cost

    embed = [{"body": {"input": "one"}}, {"body": {"input": ["a", "b", "c"]}}, {"body": {"input": [1, 2, 3]}}]
    assert batch_cost("/v1/embeddings", embed) == 5
    chat = [
        {"body": {"messages": [], "max_tokens": 10, "n": 2}},
        {"body": {"messages": [], "max_completion_tokens": 7}},
        {"body": {"messages": []}},
    ]
    assert batch_cost("/v1/chat/completions", chat) == 20 + 7 + DEFAULT_MAX_TOKENS


def test_job_websocket_closed_by_client_stops_following(server: tuple[str, _EventsWatch]) -> None:
    url, watch = server
    # one step of 30 s: no event to send for a while, so only the closed socket can end the handler
    job = _post(url, "alice", "/v1/jobs", {"kind": "test.steps", "params": {"steps": 1, "delay": 30}}).json()
    ws_url = url.replace("http", "ws") + f"/v1/jobs/{job['id']}/ws"
    with websockets.sync.client.connect(ws_url, additional_headers=_auth("alice")) as ws:
        assert json.loads(ws.recv(timeout=10))["type"]
        assert watch.active == 1
    deadline = time.monotonic() + 10
    while watch.active:
        assert time.monotonic() < deadline, "the handler still follows the events of a closed socket"
        time.sleep(0.05)
    assert httpx.post(f"{url}/v1/jobs/{job['id']}/cancel", headers=_auth("alice"), timeout=30).status_code == 200


def test_pipeline_and_transcription_kinds_have_costs() -> None:
    import pipelines.plugin  # noqa: F401 - registers audio.pipeline
    from modalities.asr import jobs as asr_jobs
    from pipelines import jobs as pipeline_jobs
    from workers.jobs.registry import get_job_kind

    asr_jobs.register()
    for kind, fn in (("audio.transcription", asr_jobs.cost), ("audio.pipeline", pipeline_jobs.cost)):
        spec = get_job_kind(kind)
        assert spec is not None and spec.cost is fn
        assert fn({}, {}, file_bytes=320_000) == ("audio_seconds", 10.0)


def test_lifespan_shuts_the_job_service_down(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from workers.jobs.runner import JobsConfig, JobService

    app = create_app({}, routers=[])
    svc = JobService(JobsConfig(store={"type": "local", "root": str(tmp_path)}), {})
    calls = []

    async def shutdown() -> None:
        calls.append(True)

    svc.shutdown = shutdown  # type: ignore[method-assign]
    app.state.jobs = svc
    with TestClient(app):
        assert not calls
    assert calls == [True]


def test_a_cancelled_attempt_keeps_what_it_ends_with_and_no_other_attempt_does() -> None:
    """Pure transitions: the attempt running when its job was cancelled may still list the files
    it puts and store the result it ends with (a cancelled batch's finished lines; all of it when
    it succeeded as the cancel came), and the job stays cancelled; another attempt's token
    (the job was queued again meanwhile) changes nothing."""
    from workers.jobs import state

    rec = state.new_record(state.new_id("job"), "test.steps", "embed", {}, max_attempts=2)
    token = rec["token"]
    running = state.claim(token, 30.0, "w")(rec)
    assert running is not None
    cancelled = state.cancel(running)
    assert cancelled is not None and cancelled["status"] == "cancelled"
    info = {"name": "output.jsonl", "bytes": 3}
    listed = state.add_file(token, info)(cancelled)
    assert listed is not None and listed["files"] == [info]
    kept = state.finish(token, "cancelled", result={"completed": 1})(listed)
    assert kept is not None and (kept["status"], kept["result"]) == ("cancelled", {"completed": 1})
    assert state.finish(token, "cancelled")(listed) is None  # nothing kept: no change
    raced = state.finish(token, "succeeded", result={"completed": 2})(listed)
    assert raced is not None and (raced["status"], raced["result"]) == ("cancelled", {"completed": 2})
    assert state.finish(token, "failed", error={"message": "x", "type": "job_error"})(listed) is None
    other = "f" * 32
    assert state.add_file(other, info)(cancelled) is None
    assert state.finish(other, "cancelled", result={"completed": 1})(cancelled) is None


def test_a_file_put_after_its_job_was_deleted_is_not_kept(tmp_path: Path) -> None:
    """A job cancelled, then deleted while its attempt still writes its partial result: the file
    that attempt puts after the deletion is removed, not left in the store with no job."""
    from workers.jobs import state
    from workers.jobs.executor import Executor
    from workers.jobs.state import MemoryBackend
    from workers.jobs.store import LocalStore
    from workers.jobs.upkeep import delete_job

    async def scenario() -> list[str]:
        backend, store = MemoryBackend(), LocalStore(tmp_path)
        rec = state.new_record(state.new_id("job"), "test.partial_file", "embed", {"finish_s": 1.0}, max_attempts=1)
        await backend.create(rec)
        run = asyncio.create_task(Executor(backend, store, {}, lease_s=3.0).execute(rec["id"], rec["token"]))
        while (await backend.get(rec["id"]))["status"] != "running":
            await asyncio.sleep(0.01)
        cancelled, _ = await backend.update(rec["id"], state.cancel)
        assert cancelled is not None and cancelled["status"] == "cancelled"
        await asyncio.sleep(0.7)  # (the attempt hears of it at its next heartbeat and finishes up)
        await delete_job(backend, store, cancelled)  # what DELETE /v1/jobs/{id} does
        await asyncio.wait_for(run, 10)
        assert await backend.get(rec["id"]) is None
        return [name for job_id, name, _ in store.entries() if job_id == rec["id"]]

    assert asyncio.run(scenario()) == []


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_listing_pages_after_a_cursor_and_refuses_an_unknown_one(kind: str) -> None:
    """(An unknown ``after`` listed from the top: a client paging past an expired item read its
    pages again.) An item its owner deleted stays a cursor."""
    from workers.jobs.redis_backend import RedisBackend
    from workers.jobs.state import MemoryBackend

    if kind == "redis" and not redis_reachable(REDIS_URL):
        pytest.skip("needs the Redis server on 127.0.0.1:6379")

    async def scenario() -> tuple[list[list[str] | None], list[str] | None]:
        backend: Any = MemoryBackend() if kind == "memory" else RedisBackend(REDIS_URL, f"page{uuid.uuid4().hex[:8]}")
        try:
            for i in range(5):
                await backend.index_add("files:alice", f"file-{i}")
                await asyncio.sleep(0.002)  # (Redis orders by the time added)
            pages, after = [], None
            while (page := await backend.index_list("files:alice", 2, after)) and len(pages) < 5:
                pages.append(page)
                after = page[-1]
            await backend.index_retire("files:alice", "file-3")  # deleted by its owner: still a cursor
            await backend.index_remove("files:alice", "file-2")  # expired: gone
            assert await backend.index_list("files:alice", 2, "file-3") == ["file-1", "file-0"]
            assert await backend.index_list("files:alice", 2, "file-2") is None
            return pages, await backend.index_list("files:alice", 2, "file-gone")
        finally:
            if kind == "redis":
                for key in await backend.r.keys(f"{backend.prefix}:*"):
                    await backend.r.delete(key)
            await backend.close()

    pages, unknown = asyncio.run(scenario())
    assert pages == [["file-4", "file-3"], ["file-2", "file-1"], ["file-0"]]
    assert unknown is None
