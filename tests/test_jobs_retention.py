"""Retention and deletion of job results, and the /v1/files upload limit:

- ``DELETE /v1/jobs/{id}`` (409 while running) and ``DELETE /v1/files/{id}`` remove the record and
  the files on disk, over real HTTP (uvicorn), tenant-checked;
- the retention sweep deletes finished jobs, orphaned result directories and old uploads past the
  TTL, and never a running job's files, the upload it reads, or anything within the TTL (memory
  state, and Redis db 13 under a unique prefix);
- ``POST /v1/files`` has its own body limit (above the gateway's) enforced while streaming, declared
  or chunked: a 413 in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import test_jobs_kinds  # noqa: F401 - registers the test job kinds
from tests.helpers import redis_reachable, serve_app, serving

KEYS = {"alice": "alice-key", "bob": "bob-key"}
TTL_S = 3600.0
GATEWAY_LIMIT, FILES_LIMIT = 2048, 8192
REDIS_URL = "redis://127.0.0.1:6379/13"


def _auth(tenant: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from gateway.app import create_app
    from gateway.auth import KeyStore, hash_key
    from workers.jobs.plugin import router
    from workers.jobs.runner import JobsConfig, JobService

    keys = KeyStore()
    for tenant, key in KEYS.items():
        keys.add_tenant(tenant, [hash_key(key)])
    app = create_app(
        {}, keys=keys, routers=[router], max_body_bytes=GATEWAY_LIMIT, body_limits={"POST /v1/files": FILES_LIMIT}
    )
    root = tmp_path_factory.mktemp("results")
    cfg = JobsConfig(store={"type": "local", "root": str(root)}, result_ttl_s=TTL_S)
    app.state.jobs = JobService(cfg, serving("embed"))
    with serve_app(app) as url:
        yield url, root


def _submit(url: str, params: dict[str, Any], tenant: str = "alice") -> str:
    resp = httpx.post(f"{url}/v1/jobs", json={"kind": "test.steps", "params": params}, headers=_auth(tenant))
    assert resp.status_code == 202, resp.text
    return str(resp.json()["id"])


def _wait(url: str, job_id: str, statuses: tuple[str, ...] = ("succeeded", "failed", "cancelled")) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while (job := httpx.get(f"{url}/v1/jobs/{job_id}", headers=_auth()).json())["status"] not in statuses:
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
    return job


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_delete_job_removes_record_and_files(server: tuple[str, Path]) -> None:
    url, root = server
    job_id = _submit(url, {"steps": 2})
    done = _wait(url, job_id)
    assert done["status"] == "succeeded" and done["expires_at"] == pytest.approx(done["finished_at"] + TTL_S)
    assert (root / job_id / "out.txt").read_bytes() == b"2 steps, attempt 1"
    file_url = done["files"][0]["url"]
    _error(httpx.delete(f"{url}/v1/jobs/{job_id}", headers=_auth("bob")), 404)  # not bob's
    resp = httpx.delete(f"{url}/v1/jobs/{job_id}", headers=_auth())
    assert resp.status_code == 200 and resp.json() == {"id": job_id, "object": "job.deleted", "deleted": True}
    assert not (root / job_id).exists()
    _error(httpx.get(f"{url}/v1/jobs/{job_id}", headers=_auth()), 404)
    _error(httpx.get(f"{url}{file_url}", headers=_auth()), 404)
    _error(httpx.delete(f"{url}/v1/jobs/{job_id}", headers=_auth()), 404)


def test_a_running_job_is_not_deleted(server: tuple[str, Path]) -> None:
    url, _ = server
    job_id = _submit(url, {"steps": 5000, "delay": 0.01})
    _wait(url, job_id, ("running",))
    assert _error(httpx.delete(f"{url}/v1/jobs/{job_id}", headers=_auth()), 409)["code"] == "job_not_finished"
    assert httpx.post(f"{url}/v1/jobs/{job_id}/cancel", headers=_auth()).status_code == 200
    assert httpx.delete(f"{url}/v1/jobs/{job_id}", headers=_auth()).status_code == 200


def test_delete_one_job_output_and_an_upload(server: tuple[str, Path]) -> None:
    url, root = server
    job_id = _submit(url, {"steps": 1})
    (info,) = _wait(url, job_id)["files"]
    _error(httpx.delete(f"{url}/v1/files/{info['id']}", headers=_auth("bob")), 404)
    resp = httpx.delete(f"{url}/v1/files/{info['id']}", headers=_auth())
    assert resp.status_code == 200 and resp.json()["deleted"] is True
    assert _wait(url, job_id)["files"] == [] and not (root / job_id / "out.txt").exists()
    _error(httpx.get(f"{url}/v1/files/{info['id']}", headers=_auth()), 404)

    up = httpx.post(
        f"{url}/v1/files", headers=_auth(), files={"file": ("a.txt", b"abc")}, data={"purpose": "user_data"}
    )
    fid = up.json()["id"]
    assert up.json()["expires_at"] == up.json()["created_at"] + int(TTL_S)
    assert (root / "uploads" / fid).read_bytes() == b"abc"
    assert httpx.delete(f"{url}/v1/files/{fid}", headers=_auth()).status_code == 200
    assert not (root / "uploads" / fid).exists()
    listed = httpx.get(f"{url}/v1/files", headers=_auth()).json()["data"]
    assert fid not in [f["id"] for f in listed]


def test_an_upload_a_running_job_reads_is_not_deleted(server: tuple[str, Path]) -> None:
    """As the sweep, ``DELETE /v1/files/{id}`` leaves the input of a queued or running job alone
    (a 409 naming the job), and deletes it once the job ended."""
    url, root = server
    up = httpx.post(
        f"{url}/v1/files", headers=_auth(), files={"file": ("a.txt", b"abc")}, data={"purpose": "user_data"}
    )
    fid = up.json()["id"]
    job_id = _submit(url, {"steps": 5000, "delay": 0.01, "file_id": fid})
    _wait(url, job_id, ("running",))
    err = _error(httpx.delete(f"{url}/v1/files/{fid}", headers=_auth()), 409)
    assert err["code"] == "file_in_use" and job_id in err["message"] and (root / "uploads" / fid).exists()
    assert httpx.post(f"{url}/v1/jobs/{job_id}/cancel", headers=_auth()).status_code == 200
    assert httpx.delete(f"{url}/v1/files/{fid}", headers=_auth()).status_code == 200
    assert not (root / "uploads" / fid).exists()


# -- the upload limit ------------------------------------------------------------------------------


def _multipart(data: bytes, boundary: str = "b0undary") -> tuple[bytes, dict[str, str]]:
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    body += data + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def test_files_have_their_own_streamed_upload_limit(server: tuple[str, Path]) -> None:
    url, root = server
    # above the gateway's limit (2 KiB, still enforced on JSON routes) but within the files limit
    body, headers = _multipart(b"z" * 6000)
    resp = httpx.post(f"{url}/v1/files", content=body, headers={**headers, **_auth()})
    assert resp.status_code == 200, resp.text
    assert resp.json()["bytes"] == 6000 and (root / "uploads" / resp.json()["id"]).read_bytes() == b"z" * 6000
    big_json = {"kind": "test.steps", "params": {"pad": "x" * 3000}}
    assert "2048 bytes" in _error(httpx.post(f"{url}/v1/jobs", json=big_json, headers=_auth()), 413)["message"]

    body, headers = _multipart(b"z" * 9000)
    err = _error(httpx.post(f"{url}/v1/files", content=body, headers={**headers, **_auth()}), 413)  # declared
    assert "8192 bytes" in err["message"] and err["type"] == "invalid_request_error"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while the upload streams
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    err = _error(httpx.post(f"{url}/v1/files", content=chunks(), headers={**headers, **_auth()}), 413)
    assert "8192 bytes" in err["message"]
    small, headers = _multipart(b"ok")
    assert httpx.post(f"{url}/v1/files", content=iter([small]), headers={**headers, **_auth()}).status_code == 200


def test_default_files_limit_is_the_documented_one() -> None:
    import argparse

    from gateway.plugins import body_limits
    from workers.jobs.plugin import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert body_limits(None)["POST /v1/files"] == 200 << 20
    assert body_limits(parser.parse_args(["--files-max-mb", "1.5"]))["POST /v1/files"] == 3 << 19


# -- the retention sweep ---------------------------------------------------------------------------


async def _finished(svc: Any, params: dict[str, Any]) -> str:
    rec, _ = await svc.submit("test.steps", params)
    while (rec := await svc.get(rec["id"]))["status"] != "succeeded":
        await asyncio.sleep(0.01)
    return str(rec["id"])


def test_sweep_deletes_only_what_outlived_the_ttl(tmp_path: Path) -> None:
    from workers.jobs.runner import JobsConfig, JobService
    from workers.jobs.store import UPLOADS

    async def scenario() -> None:
        svc = JobService(
            JobsConfig(store={"type": "local", "root": str(tmp_path)}, result_ttl_s=TTL_S), serving("embed")
        )
        store, backend = svc.store, svc.backend
        old, in_use = "file-" + "a" * 24, "file-" + "b" * 24
        for fid in (old, in_use):
            store.put(UPLOADS, fid, b"data", "text/plain")
            await backend.put_meta(f"file:{fid}", {"id": fid, "created_at": time.time(), "owner": None})
        done = await _finished(svc, {"steps": 1})
        live, _ = await svc.submit("test.steps", {"steps": 5000, "delay": 0.01, "file_id": in_use})
        while (await svc.get(live["id"]))["status"] != "running":
            await asyncio.sleep(0.01)
        store.put(live["id"], "partial.bin", b"x", "application/octet-stream")
        store.put("job_orphan", "out.txt", b"x", "text/plain")  # its record is gone (a restart)
        try:
            assert await svc.sweep(now=time.time() + TTL_S / 2) == []  # nothing is that old yet
            gone = await svc.sweep(now=time.time() + TTL_S + 60)
            assert sorted(gone) == sorted([done, "job_orphan", old])
            assert await svc.get(done) is None and await backend.get_meta(f"file:{old}") is None
            left = {(job, name) for job, name, _ in store.entries()}
            assert left == {(UPLOADS, in_use), (live["id"], "partial.bin")}
            assert (await svc.get(live["id"]))["status"] == "running"
        finally:
            await svc.cancel(live["id"])
            await svc.shutdown()

    asyncio.run(scenario())


@pytest.mark.skipif(not redis_reachable(REDIS_URL), reason="needs the Redis server on 127.0.0.1:6379")
def test_redis_records_expire_with_the_ttl_and_delete_cleanly(tmp_path: Path) -> None:
    from workers.jobs import state
    from workers.jobs.redis_backend import RedisBackend
    from workers.jobs.store import LocalStore
    from workers.jobs.upkeep import delete_job, sweep

    prefix = f"retention{uuid.uuid4().hex[:8]}:jobs"

    async def scenario() -> None:
        backend, store = RedisBackend(REDIS_URL, prefix, ttl_s=TTL_S), LocalStore(tmp_path)
        try:
            rec = state.new_record(state.new_id(), "test.steps", "embed", {}, max_attempts=1, idempotency_key="k")
            await backend.create(rec)
            key = f"{prefix}:job:{rec['id']}"
            assert rec["id"] in await backend.active_ids() and await backend.r.ttl(key) == -1
            await backend.update(rec["id"], state.claim(rec["token"], 30, "w"))
            store.put(rec["id"], "out.txt", b"x", "text/plain")
            assert await sweep(backend, store, TTL_S, now=time.time() + 10 * TTL_S) == []  # running: kept
            await backend.update(rec["id"], state.add_file(rec["token"], {"name": "out.txt"}))
            await backend.update(rec["id"], state.finish(rec["token"], "succeeded"))
            assert 0 < await backend.r.ttl(key) <= TTL_S
            await backend.update(rec["id"], state.remove_file("out.txt"))  # a later change keeps the expiry
            assert 0 < await backend.r.ttl(key) <= TTL_S
            await backend.add_event(rec["id"], state.status_event(await backend.get(rec["id"])))
            await delete_job(backend, store, await backend.get(rec["id"]))
            assert await backend.r.keys(f"{prefix}:*") == [] and not (tmp_path / rec["id"]).exists()
            store.put("job_expired", "out.txt", b"x", "text/plain")  # its record already expired
            assert await sweep(backend, store, TTL_S, now=time.time() + TTL_S + 60) == ["job_expired"]
        finally:
            for k in await backend.r.keys(f"{prefix}:*"):
                await backend.r.delete(k)
            await backend.close()

    asyncio.run(scenario())
