"""Faults under ``--dispatch celery``, on a private ``redis-server`` (stopped and restarted here;
the shared one is never touched) with two real tiny-llama ``mmserve worker`` processes.

Order matters (one cluster per module): Redis outage and recovery first, then a worker that
stops before replying (its request is retried on the other), then a worker killed mid-stream."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.helpers import serve_app
from workers.local_cluster import RedisServer, WorkerProc, start_worker, wait_for_heartbeats
from workers.routing import affinity_worker, prefix_key

PREFIX = "t-faults"
LLM = "llama-0"

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


@dataclass
class Cluster:
    redis: RedisServer
    workers: list[WorkerProc]
    url: str
    app: Any
    warnings: list[str]  # the gateway's dispatch warnings, from the start


class _Kept(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from gateway.app import build_app
    from gateway.cli import build_parser

    server = RedisServer()
    server.start()
    url = server.url()
    llm = ["--llm", str(tiny_model_dir("llama"))]
    logs = tmp_path_factory.mktemp("fault-workers")
    workers = [start_worker("llm", url, PREFIX, llm, worker_id=f"w{i}", log_dir=logs) for i in (0, 1)]
    try:
        wait_for_heartbeats(url, PREFIX, workers)
        args = build_parser().parse_args(
            ["serve", "--only", "llm", *llm, "--dispatch", "celery", "--redis-url", url, "--prefix", PREFIX]
        )
        app = build_app(args)
        app.state.cluster.sweep_s, app.state.cluster.sweep_grace_s = 0.5, 5.0  # (test_a_dead_workers_queue_is_swept)
        warnings: list[str] = []
        handler = _Kept(warnings)
        logging.getLogger("mmserve.dispatch").addHandler(handler)
        try:
            with serve_app(app) as base:
                _wait_ready(base)
                yield Cluster(server, workers, base, app, warnings)
        finally:
            logging.getLogger("mmserve.dispatch").removeHandler(handler)
    finally:
        for w in workers:
            w.kill()
        server.stop()


def _wait_ready(base: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (r := httpx.get(f"{base}/ready", timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)


def _complete(base: str, prompt: str | list[int], max_tokens: int = 4, timeout: float = 30) -> httpx.Response:
    body = {"model": LLM, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def test_redis_down_answers_503_fast_then_recovers(cluster: Cluster) -> None:
    assert _complete(cluster.url, "hello").status_code == 200
    cluster.redis.stop()
    for _ in range(3):
        start = time.monotonic()
        r = _complete(cluster.url, "hello")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"]
        assert time.monotonic() - start < 5.0
    time.sleep(0.6)  # the view refresher notices too
    assert httpx.get(f"{cluster.url}/ready").status_code == 503
    cluster.redis.start()
    _wait_ready(cluster.url, timeout_s=30)
    deadline = time.monotonic() + 30
    while (r := _complete(cluster.url, "hello")).status_code != 200:  # Celery consumers reconnect
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)


def test_worker_lost_before_replying_is_retried_elsewhere(cluster: Cluster) -> None:
    """A frozen worker (SIGSTOP: no heartbeat, consumes nothing) still in the gateway's view gets
    requests; once its heartbeat expires they are resubmitted to the other worker and succeed."""
    cluster_view = cluster.app.state.cluster
    victim, survivor = cluster.workers
    tokenizer = cluster.app.state.engines[LLM].tokenizer
    prompts = []
    for i in range(200):  # prompts whose prefix-affinity home is the victim
        ids = tokenizer.encode(" ".join(f"p{i}w{j}" for j in range(12)))
        if affinity_worker(prefix_key(ids), [victim.worker_id, survivor.worker_id]) == victim.worker_id:
            prompts.append(ids)
        if len(prompts) == 2:
            break
    expected = [_complete(cluster.url, p).json()["choices"][0]["text"] for p in prompts]  # routed to the victim
    retries = cluster_view.retries[LLM]
    victim.kill(signal.SIGSTOP)
    try:
        start = time.monotonic()
        got = [_complete(cluster.url, p) for p in prompts]
        assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
        assert [r.json()["choices"][0]["text"] for r in got] == expected
        assert time.monotonic() - start < 20
        assert cluster_view.retries[LLM] > retries
        assert cluster_view.model_stats(LLM)["dispatch_retries_total"] == cluster_view.retries[LLM]
    finally:
        victim.kill(signal.SIGKILL)
        victim.proc.wait(10)  # (reaped: the next test counts the live workers by ``poll()``)


def test_a_dead_workers_queue_is_swept(cluster: Cluster) -> None:
    """The worker killed above left its own queue (the calls resubmitted elsewhere) and that
    queue's Celery bindings; the gateway removes them once its heartbeat is gone for the grace
    period (5 s here). The survivor's stay, and it still serves."""
    import redis

    from workers.celery_app import queue_keys, worker_queue

    (dead,) = [w for w in cluster.workers if w.proc.poll() is not None]
    (live,) = [w for w in cluster.workers if w.proc.poll() is None]
    client = redis.Redis.from_url(cluster.redis.url())
    leftovers = queue_keys(worker_queue(dead.worker_id, PREFIX))
    deadline = time.monotonic() + 20
    while client.exists(*leftovers):
        assert time.monotonic() < deadline, "the dead worker's queue was not swept"
        time.sleep(0.2)
    assert client.keys(f"*{worker_queue(dead.worker_id, PREFIX)}*") == []  # (whatever kombu named after it)
    swept = [m for m in cluster.warnings if "died without stopping" in m]
    assert len(swept) == 1 and f"worker {dead.worker_id} " in swept[0]  # (the sweeper did it: it found them)
    assert client.exists(f"_kombu.binding.{worker_queue(live.worker_id, PREFIX)}") == 1
    assert _complete(cluster.url, "hello").status_code == 200


def test_worker_killed_mid_stream_ends_with_an_error_event(cluster: Cluster) -> None:
    (worker,) = [w for w in cluster.workers if w.proc.poll() is None]
    body = {"model": LLM, "prompt": "go", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    events: list[dict[str, Any]] = []
    start = time.monotonic()
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:
                worker.kill(signal.SIGKILL)
    assert time.monotonic() - start < 20
    assert "error" in events[-1], events[-1]
    assert events[-1]["error"]["code"] == "worker_lost"
    r = _complete(cluster.url, "hello")  # nobody left to serve it: a clear 503, not a hang
    assert r.status_code == 503 and r.json()["error"]["code"] in ("no_workers", "worker_lost")
