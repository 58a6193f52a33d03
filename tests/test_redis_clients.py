"""The cluster's Redis clients: the worker's and the stage store's ride through a Redis restart
(``workers.wire.restart_retry``; a private ``redis-server``, stopped and restarted here)."""

from __future__ import annotations

import shutil

import pytest

from pipelines.stage_store import shared_store


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_workers_redis_clients_ride_through_a_redis_restart() -> None:
    """After Redis restarts, the first command of the worker runtime's async client (heartbeats,
    call streams) and of the stage store succeeds, on a fresh connection: its pooled ones are
    stale. (The runtime's client was given the sync ``Retry``, which an async client runs without
    retrying: that first command failed.)"""
    from workers.local_cluster import RedisServer
    from workers.runtime import WorkerRuntime

    server = RedisServer()
    server.start()
    rt = WorkerRuntime("w1", "llm", {}, server.url(), prefix="t-restart", heartbeat_s=60.0)
    rt.start()
    try:
        assert rt.redis is not None
        store = shared_store(server.url(), "t-restart")
        rt.run(rt.redis.set("t-restart:k", "1"))
        store.r.set("t-restart:k", "1")
        server.stop()
        server.start()
        assert rt.run(rt.redis.get("t-restart:k")) is None  # (a fresh Redis: no persistence)
        assert store.r.get("t-restart:k") is None
    finally:
        rt.stop()
        server.stop()
