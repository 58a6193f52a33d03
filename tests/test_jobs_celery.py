"""The job system under the Celery runner: a real Redis (db 13, a unique prefix), real
``mmserve worker --modality embed`` processes (the embedding model plus the test job kinds from
``tests/test_jobs_kinds.py``), and the gateway's job routes over real HTTP. Covers running,
ordered SSE progress, cancel, idempotency through Redis, an embeddings batch on the worker, and a
killed worker's job being retried elsewhere, or failed once its attempts are used up."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import redis_reachable, serve_app, serving
from tests.test_jobs import error, get, post, sse, wait

REDIS_URL = "redis://127.0.0.1:6379/13"
ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.skipif(not redis_reachable(REDIS_URL), reason="needs the Redis server on 127.0.0.1:6379")


class Cluster:
    def __init__(self, prefix: str, results: Path) -> None:
        self.prefix, self.results = prefix, results
        self.workers: list[subprocess.Popen[bytes]] = []
        self.base = ""

    def start_worker(self) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "MMSERVE_JOB_MODULES": "tests.test_jobs_kinds",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "worker",
            "--modality",
            "embed",
            "--redis-url",
            REDIS_URL,
            "--prefix",
            self.prefix,
            "--concurrency",
            "4",
            "--heartbeat-s",
            "0.5",
            "--log-level",
            "warning",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")  # the test Redis is local and private
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        self.workers.append(proc)
        return proc

    def wait_workers(self, n: int) -> None:
        """Until ``n`` workers publish their heartbeat (their engines are up)."""
        import redis

        from workers.wire import Keys

        r = redis.Redis.from_url(REDIS_URL)
        deadline = time.monotonic() + 90
        while len(r.keys(Keys(self.prefix).worker_pattern)) < n:
            assert time.monotonic() < deadline, "workers did not start"
            assert all(w.poll() is None for w in self.workers), "a worker exited during start-up"
            time.sleep(0.2)


def jobs_config(prefix: str, results: Path, max_attempts: int = 2) -> Any:
    """Celery runner settings: short leases so a dead worker is noticed within ~2 s."""
    from workers.jobs.runner import JobsConfig

    return JobsConfig(
        dispatch="celery",
        redis_url=REDIS_URL,
        key_prefix=f"{prefix}:jobs",
        queue_prefix=prefix,
        store={"type": "local", "root": str(results)},
        max_attempts=max_attempts,
        lease_s=1.5,
        reap_interval_s=0.3,
        redispatch_after_s=1.0,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from gateway.app import create_app
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobService

    prefix = f"t{uuid.uuid4().hex[:8]}"
    c = Cluster(prefix, tmp_path_factory.mktemp("results"))
    c.start_worker()
    c.start_worker()
    app = create_app({}, api_key="jobs-key", routers=[jobs_router])
    app.state.jobs = JobService(jobs_config(prefix, c.results), serving("embed"))  # (the workers' modality)
    try:
        c.wait_workers(2)
        with serve_app(app) as base:
            c.base = base
            yield c
    finally:
        for w in c.workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in c.workers:
            try:
                w.wait(15)
            except subprocess.TimeoutExpired:
                w.kill()
        import redis

        r = redis.Redis.from_url(REDIS_URL)
        for key in r.scan_iter(f"{prefix}*"):
            r.delete(key)


def test_job_runs_on_a_worker_with_ordered_progress(cluster: Cluster) -> None:
    job = post(cluster.base, "/v1/jobs", {"kind": "test.steps", "params": {"steps": 8}, "preview": True}).json()
    events = sse(cluster.base, f"/v1/jobs/{job['id']}/events?previews=true")
    assert [e[1]["status"] for e in events if e[0] == "status"] == ["queued", "running", "succeeded"]
    progress = [e[1] for e in events if e[0] == "progress"]
    assert [(p["step"], p["total"]) for p in progress] == [(i, 8) for i in range(1, 9)]
    assert all(p["preview"] for p in progress)
    done = get(cluster.base, f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and done["attempts"] == 1 and done["progress"]["step"] == 8
    assert get(cluster.base, done["files"][0]["url"]).content == b"8 steps, attempt 1"  # written by the worker


def test_cancel_reaches_the_worker(cluster: Cluster) -> None:
    job = post(cluster.base, "/v1/jobs", {"kind": "test.steps", "params": {"steps": 3000, "delay": 0.005}}).json()
    wait(cluster.base, job["id"], ("running",))
    assert post(cluster.base, f"/v1/jobs/{job['id']}/cancel", None).json()["status"] == "cancelled"
    time.sleep(1.0)  # the worker notices within its heartbeat period (0.5 s)
    step = get(cluster.base, f"/v1/jobs/{job['id']}").json()["progress"]["step"]
    time.sleep(0.5)
    after = get(cluster.base, f"/v1/jobs/{job['id']}").json()
    assert after["status"] == "cancelled" and after["progress"]["step"] == step < 3000


def test_concurrent_submits_with_one_idempotency_key(cluster: Cluster) -> None:
    body = {"kind": "test.steps", "params": {"steps": 2}}
    key = {"Idempotency-Key": uuid.uuid4().hex}
    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(lambda _: post(cluster.base, "/v1/jobs", body, headers=key).json()["id"], range(8)))
    assert len(ids) == 1
    done = wait(cluster.base, ids.pop())
    assert done["status"] == "succeeded" and done["attempts"] == 1
    other = {"kind": "test.steps", "params": {"steps": 3}}
    error(post(cluster.base, "/v1/jobs", other, headers=key), 409)


def test_embeddings_batch_runs_on_the_embed_worker(cluster: Cluster) -> None:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": f"text {i}"}}
        for i in range(20)
    ]
    files = {"file": ("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode(), "application/jsonl")}
    headers = {"Authorization": "Bearer jobs-key"}
    up = httpx.post(f"{cluster.base}/v1/files", files=files, data={"purpose": "batch"}, headers=headers).json()
    body = {"input_file_id": up["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
    batch = post(cluster.base, "/v1/batches", body).json()
    done = wait(cluster.base, batch["id"])
    assert done["status"] == "succeeded", done
    batch = get(cluster.base, f"/v1/batches/{batch['id']}").json()
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
    out = [json.loads(x) for x in get(cluster.base, f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(20)]
    assert all(len(o["response"]["body"]["data"][0]["embedding"]) == 384 for o in out)


def test_kinds_whose_modality_is_not_served_are_400(tmp_path: Path) -> None:
    """As under the local runner (a gateway started with ``--only asr``: no embed or llm proxy),
    and no task waits on a queue for a worker."""
    import redis

    from tests.test_jobs import check_unserved_kinds_are_400

    prefix = f"t{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(REDIS_URL)
    try:
        check_unserved_kinds_are_400(jobs_config(prefix, tmp_path))
        assert r.llen(f"{prefix}.embed") == r.llen(f"{prefix}.llm") == 0
        assert not list(r.scan_iter(f"{prefix}:jobs:job:*")) and not r.zcard(f"{prefix}:jobs:queued")
    finally:
        for key in r.scan_iter(f"{prefix}*"):
            r.delete(key)


def test_lost_message_is_sent_again(cluster: Cluster) -> None:
    """A queued job whose Celery message was lost (e.g. reserved by a worker that died) runs anyway."""
    from workers.jobs.runner import JobService

    async def submit_and_lose_the_message() -> str:
        svc = JobService(jobs_config(cluster.prefix, cluster.results), serving("embed"))

        async def lost(rec: Any) -> None:
            return None

        svc.runner.dispatch = lost  # type: ignore[method-assign]
        rec, _ = await svc.submit("test.steps", {"steps": 2})
        await svc.shutdown()
        return rec["id"]

    job_id = asyncio.run(submit_and_lose_the_message())
    done = wait(cluster.base, job_id)
    assert done["status"] == "succeeded" and done["attempts"] == 1


def _pid_running(cluster: Cluster, job_id: str) -> int:
    """The pid of the worker process running ``job_id`` once it made progress."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job = get(cluster.base, f"/v1/jobs/{job_id}").json()
        if job["status"] == "running" and job["progress"]["step"] > 0:
            return _worker_pid(cluster, job_id)
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not start")


def _worker_pid(cluster: Cluster, job_id: str) -> int:
    import redis

    rec = json.loads(redis.Redis.from_url(REDIS_URL).get(f"{cluster.prefix}:jobs:job:{job_id}"))
    return int(rec["worker"].rsplit(":", 1)[1])


def test_killed_worker_job_is_retried_then_failed(cluster: Cluster) -> None:
    # attempt 1 dies with its worker; the reaper requeues it and the other worker finishes it
    job = post(cluster.base, "/v1/jobs", {"kind": "test.steps", "params": {"steps": 150, "delay": 0.02}}).json()
    first = _pid_running(cluster, job["id"])
    os.kill(first, signal.SIGKILL)
    done = wait(cluster.base, job["id"])
    assert done["status"] == "succeeded" and done["attempts"] == 2 and done["result"]["attempt"] == 2
    assert _worker_pid(cluster, job["id"]) != first
    # with max_attempts=1 a job whose worker dies is failed, not left running
    from workers.jobs.runner import JobService

    async def submit() -> str:
        svc = JobService(jobs_config(cluster.prefix, cluster.results, max_attempts=1), serving("embed"))
        rec, _ = await svc.submit("test.steps", {"steps": 3000, "delay": 0.01})
        await svc.shutdown()
        return rec["id"]

    job_id = asyncio.run(submit())
    os.kill(_pid_running(cluster, job_id), signal.SIGKILL)
    failed = wait(cluster.base, job_id)
    assert failed["status"] == "failed" and failed["attempts"] == 1
    assert "worker" in failed["error"]["message"] and failed["error"]["type"] == "worker_lost"
