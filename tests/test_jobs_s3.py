"""The S3 result store against a real S3-compatible server (moto's standalone server, started as a
subprocess on a loopback port; boto3 talks HTTP to it): put/get/delete, and a job whose result
file goes to the bucket and is fetched back through the gateway URL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("boto3", reason="boto3 is the optional S3 dependency (pip install boto3)")
pytest.importorskip("moto.server", reason="moto[server] provides the local S3-compatible server")

from tests import test_jobs_kinds  # noqa: E402,F401 - registers the test job kinds
from tests.helpers import serve_app, serving  # noqa: E402
from tests.test_jobs import wait  # noqa: E402


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
            time.sleep(0.1)
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    try:
        yield url
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str) -> str:
    import boto3

    name = f"mmserve-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def test_s3_store_roundtrip(s3_endpoint: str, bucket: str) -> None:
    from workers.jobs.store import make_store

    store = make_store({"type": "s3", "bucket": bucket, "prefix": "p/", "endpoint_url": s3_endpoint})
    assert store.put("job_1", "a.png", b"\x89PNG", "image/png") == "/v1/files/file-job_1--a.png/content"
    store.put("job_1", "b.txt", b"hi", "text/plain")
    assert store.get("job_1", "a.png") == (b"\x89PNG", "image/png")
    store.delete_job("job_1")
    with pytest.raises(FileNotFoundError):
        store.get("job_1", "b.txt")
    with pytest.raises(ValueError):
        store.put("job_1", "../x", b"", "text/plain")


def test_job_results_in_the_bucket_fetched_by_url(s3_endpoint: str, bucket: str) -> None:
    import boto3

    from gateway.app import create_app
    from workers.jobs.plugin import router
    from workers.jobs.runner import JobsConfig, JobService

    app = create_app({}, routers=[router])
    store = {"type": "s3", "bucket": bucket, "prefix": "results/", "endpoint_url": s3_endpoint}
    app.state.jobs = JobService(JobsConfig(store=store), serving("embed"))
    with serve_app(app) as base:
        job = httpx.post(f"{base}/v1/jobs", json={"kind": "test.steps", "params": {"steps": 2}}).json()
        done = wait(base, job["id"])
        assert done["status"] == "succeeded"
        assert httpx.get(base + done["files"][0]["url"]).content == b"2 steps, attempt 1"
    key = f"results/{job['id']}/out.txt"
    obj = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").get_object(Bucket=bucket, Key=key)
    assert obj["Body"].read() == b"2 steps, attempt 1" and obj["ContentType"] == "text/plain"


def test_s3_sweep_and_streamed_put(s3_endpoint: str, bucket: str) -> None:
    """The retention sweep on a bucket: finished and orphaned jobs and old uploads go; a running
    job's files and the upload it reads stay. ``put_file`` streams; ``delete_job`` deletes them all."""
    import asyncio
    import io

    from workers.jobs import state
    from workers.jobs.store import UPLOADS, make_store
    from workers.jobs.upkeep import sweep

    store = make_store({"type": "s3", "bucket": bucket, "prefix": "sweep/", "endpoint_url": s3_endpoint})
    assert store.put_file(UPLOADS, "file-in-use", io.BytesIO(b"in"), "text/plain").endswith("file-in-use/content")
    store.put(UPLOADS, "file-old", b"old", "text/plain")
    store.put("job_orphan", "out.txt", b"x", "text/plain")
    backend = state.MemoryBackend()

    async def scenario() -> list[str]:
        ids = {}
        for status in ("succeeded", "running"):
            rec = state.new_record(state.new_id(), "test.steps", "embed", {"file_id": "file-in-use"}, max_attempts=1)
            await backend.create(rec)
            await backend.update(rec["id"], state.claim(rec["token"], 30, "w"))
            if status == "succeeded":
                await backend.update(rec["id"], state.finish(rec["token"], "succeeded"))
            for i in range(3):
                store.put(rec["id"], f"part-{i}.bin", b"x", "application/octet-stream")
            ids[status] = rec["id"]
        gone = await sweep(backend, store, 60.0, now=time.time() + 3600)
        assert sorted(gone) == sorted([ids["succeeded"], "job_orphan", "file-old"])
        return [ids["running"]]

    (running,) = asyncio.run(scenario())
    left = sorted((job, name) for job, name, _ in store.entries())
    assert left == [(running, "part-0.bin"), (running, "part-1.bin"), (running, "part-2.bin"), (UPLOADS, "file-in-use")]
    assert store.get(UPLOADS, "file-in-use") == (b"in", "text/plain")
    store.delete_job(running)
    assert [job for job, _, _ in store.entries()] == [UPLOADS]
