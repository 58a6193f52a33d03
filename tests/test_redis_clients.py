"""The cluster's Redis clients: the stage store's is one per Redis per process, whatever the prefix
and however many threads ask at once (``pipelines.stage_store.shared_store``; the real Redis, db
14), and the worker's and the stage store's ride through a Redis restart (``workers.wire.
restart_retry``; a private ``redis-server``, stopped and restarted here)."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from typing import Any

import pytest

from pipelines.stage_store import shared_store

REDIS_URL = "redis://127.0.0.1:6379/14"


def test_the_stage_store_has_one_client_per_redis_in_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same store for the same prefix, the same client (one connection pool) for every prefix
    on one Redis, another for another Redis; threads asking at once for a store not made yet
    all get the one store (a check-then-make under no lock made one each)."""
    import redis

    store = shared_store(REDIS_URL, "t-clients-a")
    assert shared_store(REDIS_URL, "t-clients-a") is store
    assert shared_store(REDIS_URL, "t-clients-b").r is store.r
    assert shared_store("redis://127.0.0.1:6379/15", "t-clients-a").r is not store.r

    made: list[str] = []
    real = redis.Redis.from_url

    def slow(url: str, **kw: Any) -> Any:  # (making a client takes a moment: threads overlap)
        made.append(url)
        time.sleep(0.1)
        return real(url, **kw)

    monkeypatch.setattr(redis.Redis, "from_url", slow)
    # A Redis URL no client was made for yet (a password of its own: the client never connects here).
    fresh, got = f"redis://:{uuid.uuid4().hex}@127.0.0.1:6379/14", []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        got.append(shared_store(fresh, "t-clients-a"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(s is got[0] for s in got) and got[0].r is not store.r
    assert made == [fresh]  # (one client made, while the other threads waited for it)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_redis_clients_ride_through_a_redis_restart() -> None:
    """After Redis restarts, the first command of the worker runtime's async client (heartbeats,
    call streams), of the stage store, of the job store and of the rate limiter succeeds, on a
    fresh connection: its pooled ones are stale. (The runtime's client was given the sync
    ``Retry``, which an async client runs without retrying, and the job store's and the rate
    limiter's none: that first command failed, a 503 from the limiter.)"""
    from gateway.ratelimit import RedisRateLimiter
    from workers.jobs.redis_backend import RedisBackend
    from workers.local_cluster import RedisServer
    from workers.runtime import WorkerRuntime

    server = RedisServer()
    server.start()
    rt = WorkerRuntime("w1", "llm", {}, server.url(), prefix="t-restart", heartbeat_s=60.0)
    rt.start()
    try:
        assert rt.redis is not None
        store = shared_store(server.url(), "t-restart")
        jobs = RedisBackend(server.url(), prefix="t-restart:jobs")
        limiter = RedisRateLimiter(server.url(), prefix="t-restart:rl:")
        rt.run(rt.redis.set("t-restart:k", "1"))
        store.r.set("t-restart:k", "1")
        rt.run(jobs.put_meta("k", {"v": 1}))
        assert rt.run(limiter.take("tenant", 5, 10)) == 0.0
        server.stop()
        server.start()
        assert rt.run(rt.redis.get("t-restart:k")) is None  # (a fresh Redis: no persistence)
        assert store.r.get("t-restart:k") is None
        assert rt.run(jobs.get_meta("k")) is None
        assert rt.run(limiter.take("tenant", 5, 10)) == 0.0  # (a fresh bucket)
        rt.run(jobs.r.aclose())
        rt.run(limiter.aclose())
    finally:
        rt.stop()
        server.stop()
