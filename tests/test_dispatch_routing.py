"""The routing policy of ``--dispatch celery`` (pure logic: no Redis, no workers; the last test:
a worker runtime with no engines on the real Redis)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.routing import WorkerLoad, affinity_worker, choose_worker, least_loaded, prefix_key


def _w(wid: str, inflight: int = 0, capacity: int = 8, kv: float = 0.0, local: int = 0) -> WorkerLoad:
    return WorkerLoad(wid, ["m"], capacity=capacity, inflight=inflight, kv_usage=kv, local_inflight=local)


def test_prefix_key_uses_only_the_leading_full_blocks() -> None:
    base = list(range(40))
    assert prefix_key(base[:15]) is None  # no full block: nothing cached to share
    assert prefix_key(base[:16]) == prefix_key(base[:16] + [999])  # the partial block is ignored
    assert prefix_key(base) == prefix_key(base[:32] + [7, 7, 7])  # only the first 2 blocks count
    assert prefix_key(base[:16]) != prefix_key(base[:32])
    assert prefix_key(base, num_blocks=1) == prefix_key(base[:16])
    assert prefix_key(base, block_size=8, num_blocks=4) == prefix_key(base[:32], block_size=8, num_blocks=4)


@given(st.lists(st.integers(0, 50_000), min_size=16, max_size=80))
def test_same_prefix_same_worker(ids: list[int]) -> None:
    workers = [_w("a"), _w("b"), _w("c")]
    key = prefix_key(ids)
    assert choose_worker(workers, key) is choose_worker(list(reversed(workers)), key)


def test_rendezvous_moves_only_the_keys_of_a_removed_worker() -> None:
    keys = [f"k{i}" for i in range(300)]
    before = {k: affinity_worker(k, ["a", "b", "c"]) for k in keys}
    after = {k: affinity_worker(k, ["a", "c"]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "b")
    assert {before[k] for k in keys} == {"a", "b", "c"}  # spread over every worker


def test_least_loaded_relative_to_capacity() -> None:
    assert least_loaded([_w("a", 3, capacity=4), _w("b", 4, capacity=16)]).worker_id == "b"
    assert least_loaded([_w("a", 1, kv=0.9), _w("b", 1, kv=0.1)]).worker_id == "b"
    assert least_loaded([]) is None


def test_gateway_inflight_counts_between_heartbeats() -> None:
    assert _w("a", inflight=1, local=5).load == 5
    assert least_loaded([_w("a", local=3), _w("b", inflight=1)]).worker_id == "b"


def test_affinity_falls_back_when_overloaded_or_much_busier() -> None:
    key = "some-prefix"
    ids = ["a", "b"]
    home = affinity_worker(key, ids)
    other = next(i for i in ids if i != home)

    def pick(home_load: int, other_load: int, capacity: int = 8, kv: float = 0.0) -> str:
        ws = [_w(home, home_load, capacity, kv), _w(other, other_load, capacity)]
        chosen = choose_worker(ws, key, slack=4)
        assert chosen is not None
        return chosen.worker_id

    assert pick(0, 0) == home
    assert pick(3, 0) == home  # within slack: keep the cache
    assert pick(5, 0) == other  # too much busier
    assert pick(8, 6) == other  # full while the other has room
    assert pick(8, 8) == home  # both full: keep the cache
    assert pick(0, 0, kv=0.99) == other  # KV cache nearly exhausted


def test_no_key_goes_least_loaded_and_exclude_skips_tried_workers() -> None:
    ws = [_w("a", 2), _w("b", 1), _w("c", 3)]
    assert choose_worker(ws, None).worker_id == "b"
    assert choose_worker(ws, None, exclude={"b"}).worker_id == "a"
    key = "k"
    home = choose_worker(ws, key)
    assert home is not None
    retry = choose_worker(ws, key, exclude={home.worker_id})
    assert retry is not None and retry.worker_id != home.worker_id
    assert choose_worker(ws, key, exclude={"a", "b", "c"}) is None


def test_heartbeat_parsing() -> None:
    w = WorkerLoad.from_heartbeat(
        {"worker_id": "x", "models": ["m"], "capacity": 0, "inflight": 2, "queue_depth": 3, "kv_usage": 0.5}
    )
    assert (w.capacity, w.load, w.kv_usage, w.models) == (1, 5, 0.5, ["m"])


def test_a_call_a_full_worker_refuses_goes_to_another_and_is_a_429_only_when_all_are_full() -> None:
    """``Cluster.call`` over stand-in replies (no Redis): a worker's ``HeldBoundError`` (refused
    before any work) sends the call to the next live worker, past ``max_attempts`` (those are for
    lost workers); with every worker full, the caller gets the soonest Retry-After. Any other
    ``QueueFullError`` (it may come after work, e.g. from a decoder queue) is the caller's."""
    import asyncio

    from engine.admission import HeldBoundError
    from engine.errors import QueueFullError
    from workers.remote import Cluster
    from workers.wire import END, START

    cluster = Cluster("redis://127.0.0.1:1/0", max_attempts=2)
    cluster.redis, cluster.redis_ok = object(), True  # type: ignore[assignment]
    ids = ["w0", "w1", "w2", "w3"]
    cluster.workers = {w: WorkerLoad(w, models=["m"], capacity=4) for w in ids}
    full: dict[str, float] = {}  # worker -> its Retry-After
    other_error: list[BaseException] = []
    tried: list[str] = []

    async def call_on(worker_id: str, call: object) -> Any:
        tried.append(worker_id)
        yield START, worker_id
        if other_error:
            raise other_error[0]
        if worker_id in full:
            raise HeldBoundError(4, full[worker_id], "in progress")
        yield END, f"done by {worker_id}"

    cluster._call_on = call_on  # type: ignore[method-assign]

    async def run() -> list[tuple[bytes, Any]]:
        return [x async for x in cluster.call("m", "run")]

    full.update(w0=8.0, w1=3.0, w2=5.0)  # three full workers, more than max_attempts
    assert asyncio.run(run())[-1] == (END, "done by w3")
    assert len(tried) == 4 and not cluster.retries  # (a refusal is not a lost worker)
    full["w3"] = 9.0
    tried.clear()
    with pytest.raises(HeldBoundError) as info:
        asyncio.run(run())
    assert sorted(tried) == ids and info.value.retry_after_s == 3.0
    assert "16 requests are already in progress on the 4 workers serving 'm'" in str(info.value)
    full.clear()
    other_error.append(QueueFullError(1024))
    tried.clear()
    with pytest.raises(QueueFullError):
        asyncio.run(run())
    assert len(tried) == 1


def test_a_gateway_that_starts_without_redis_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """(Before, the first failed reading was silent: a gateway with a wrong ``--redis-url`` started
    with no word in its log, then answered every call with a 503.) The log names where, never
    the URL's password."""
    import asyncio
    import logging

    from workers.remote import Cluster

    async def go() -> None:
        cluster = Cluster("redis://:hush@127.0.0.1:1/0", socket_timeout_s=0.5)  # (nothing listens on port 1)
        await cluster.start()
        await cluster.shutdown()

    with caplog.at_level(logging.WARNING):
        asyncio.run(go())
    assert "Redis at 127.0.0.1:1/0 is unreachable" in caplog.text and "hush" not in caplog.text


def test_a_call_on_a_draining_worker_is_resubmitted_at_once() -> None:
    """A call not started on a worker whose heartbeat says it is shutting down goes elsewhere at
    the first silent poll (it took ``start_timeout_s``, 3 s, before), without counting as a lost
    worker; a started one waits."""
    import asyncio
    import json
    import time

    from workers.remote import DRAINING, LOST, Cluster
    from workers.wire import END

    cluster = Cluster("redis://127.0.0.1:1/0")
    now = time.time()
    draining = json.dumps({"worker_id": "w", "models": ["m"], "draining": True, "ts": now}).encode()
    serving = json.dumps({"worker_id": "w", "models": ["m"], "inflight": 8, "capacity": 8, "ts": now}).encode()
    assert cluster._lost("w", draining, started=False, sent_at=now - 0.5) == DRAINING
    assert cluster._lost("w", draining, started=True, sent_at=now - 0.5) is None
    assert cluster._lost("w", serving, started=False, sent_at=now - 0.5) is None
    assert cluster._lost("w", None, started=True, sent_at=now - 0.5) == LOST  # (no heartbeat: gone)

    # A call the draining worker never started goes to another: not a lost worker (no retry
    # counted, no attempt used, the worker stays in the view to finish its own calls).
    cluster = Cluster("redis://127.0.0.1:1/0", max_attempts=1)
    cluster.redis, cluster.redis_ok = object(), True  # type: ignore[assignment]
    cluster.workers = {w: WorkerLoad(w, models=["m"], capacity=4) for w in ("w0", "w1")}

    async def call_on(worker_id: str, call: object) -> Any:
        if worker_id == "w0":
            yield None, DRAINING
            return
        yield END, f"done by {worker_id}"

    cluster._call_on = call_on  # type: ignore[method-assign]
    cluster.workers["w1"].inflight = 3  # (w0 is chosen first: the least loaded)

    async def run() -> list[tuple[bytes, Any]]:
        return [x async for x in cluster.call("m", "run")]

    assert asyncio.run(run()) == [(END, "done by w1")]
    assert not cluster.retries and set(cluster.workers) == {"w0", "w1"}


def _redis_db11(name: str) -> tuple[str, str, Any]:
    """The real Redis's db 11, a fresh key prefix starting with ``name`` and a client (the test
    is skipped without Redis)."""
    import uuid

    redis = pytest.importorskip("redis")
    url = "redis://127.0.0.1:6379/11"
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.exceptions.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    return url, f"{name}-{uuid.uuid4().hex[:8]}", client


def _fill(client: Any, keys: list[str]) -> None:
    """A member in each of a queue's binding sets (``_kombu.*``), a call in each of its lists."""
    for key in keys:
        if key.startswith("_kombu"):
            client.sadd(key, "a binding")
        else:
            client.rpush(key, "a call")


def test_a_draining_worker_says_so_at_once_and_leaves_no_queue_behind() -> None:
    """``WorkerRuntime`` on the real Redis (db 11, a prefix of its own): ``drain`` publishes a
    draining heartbeat now, not a period later; ``stop`` deletes the heartbeat, the worker's own
    queue (calls in it never started: the gateway resubmits them) and its Celery bindings, and
    the runtime stops being ``current()`` (a later local job in this process took the Celery path
    on its dead loop's Redis client)."""
    import json
    import time

    from workers import runtime
    from workers.celery_app import queue_keys, worker_queue
    from workers.runtime import WorkerRuntime
    from workers.wire import Keys

    url, prefix, client = _redis_db11("t-drain")
    rt = WorkerRuntime("w1", "llm", {}, url, prefix=prefix, heartbeat_s=60.0)
    rt.start()
    assert runtime.current() is rt
    beat, queue = Keys(prefix).worker("w1"), worker_queue("w1", prefix)
    try:
        deadline = time.monotonic() + 10
        while not client.exists(beat):  # (the first heartbeat, a task started with the runtime)
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.02)
        assert json.loads(client.get(beat))["draining"] is False
        _fill(client, queue_keys(queue))  # (its lists and binding sets, as kombu makes them)
        rt.drain()
        assert json.loads(client.get(beat))["draining"] is True
    finally:
        rt.stop()
    assert client.exists(beat, *queue_keys(queue)) == 0
    assert runtime.current() is None


def test_the_sweeper_removes_only_what_dead_workers_left_and_only_after_the_grace() -> None:
    """``DeadQueues`` on the real Redis (db 11, a prefix of its own), with keys as kombu lays them
    out: a dead worker's queue lists, bindings and unacked calls go once it has been dead for the
    grace period; a live worker's (heartbeat present), one whose heartbeat came back within the
    grace, and other queues' unacked calls stay."""
    import asyncio
    import json

    import redis.asyncio as aioredis

    from workers.celery_app import queue_keys, worker_queue
    from workers.sweeper import UNACKED, UNACKED_INDEX, DeadQueues
    from workers.wire import Keys

    url, prefix, client = _redis_db11("t-sweep")
    dead, live, back = (worker_queue(w, prefix) for w in ("dead", "live", "back"))
    tags = {f"{prefix}-t{i}": q for i, q in enumerate((dead, dead, live, back))}
    client.set(Keys(prefix).worker("live"), "{}")
    every = [k for q in (dead, live, back) for k in queue_keys(q)]
    _fill(client, every)
    for tag, q in tags.items():
        client.hset(UNACKED, tag, json.dumps([{"body": "..."}, q, q]))
        client.zadd(UNACKED_INDEX, {tag: 1.0})

    async def sweeps() -> list[list[str]]:
        r = aioredis.Redis.from_url(url)
        try:
            sweeper = DeadQueues(r, prefix, grace_s=0.3)
            first = await sweeper.sweep()  # (dead since now: not yet)
            await r.set(Keys(prefix).worker("back"), "{}")  # (restarted under its id)
            await asyncio.sleep(0.4)
            return [first, await sweeper.sweep(), await sweeper.sweep()]
        finally:
            await r.aclose()

    try:
        assert asyncio.run(sweeps()) == [[], ["dead"], []]
        assert client.exists(*queue_keys(dead)) == 0
        assert client.exists(*queue_keys(live), *queue_keys(back)) == 2 * len(queue_keys(live))
        left = {t.decode() for t in client.hkeys(UNACKED)} & set(tags)
        assert left == {f"{prefix}-t2", f"{prefix}-t3"}
        assert {t.decode() for t in client.zrange(UNACKED_INDEX, 0, -1)} & set(tags) == left
    finally:
        client.delete(Keys(prefix).worker("live"), Keys(prefix).worker("back"), *every)
        client.hdel(UNACKED, *tags)
        client.zrem(UNACKED_INDEX, *tags)


def test_a_worker_restarted_under_its_id_forgets_what_its_former_life_had_taken() -> None:
    """A worker killed and started again under the same ``--worker-id`` before the sweeper's
    grace: as its runtime starts, before its heartbeat is up, its former life's queue, bindings
    and unacked calls go (Celery would put those calls back on its queue after the visibility
    timeout and run them again, long after the gateway resubmitted them); other queues' unacked
    calls (a chain stage on the modality queue: still wanted) stay. A worker of that id that is
    alive (two workers given one id) loses nothing."""
    import json

    from workers.celery_app import modality_queue, queue_keys, worker_queue
    from workers.runtime import WorkerRuntime
    from workers.sweeper import UNACKED, UNACKED_INDEX
    from workers.wire import Keys

    url, prefix, client = _redis_db11("t-reborn")
    own, shared, twin = worker_queue("w1", prefix), modality_queue("llm", prefix), worker_queue("w2", prefix)
    tags = {f"{prefix}-t0": own, f"{prefix}-t1": own, f"{prefix}-t2": shared, f"{prefix}-t3": twin}
    every = [*queue_keys(own), *queue_keys(twin)]
    _fill(client, every)
    for tag, q in tags.items():
        client.hset(UNACKED, tag, json.dumps([{"body": "..."}, q, q]))
        client.zadd(UNACKED_INDEX, {tag: 1.0})
    client.set(Keys(prefix).worker("w2"), "{}", px=60_000)  # (w2 is alive elsewhere)
    reborn = [WorkerRuntime(w, "llm", {}, url, prefix=prefix, heartbeat_s=60.0) for w in ("w1", "w2")]
    try:
        for rt in reborn:
            rt.start()
        assert client.exists(*queue_keys(own)) == 0
        assert client.exists(*queue_keys(twin)) == len(queue_keys(twin))
        left = {t.decode() for t in client.hkeys(UNACKED)} & set(tags)
        assert left == {f"{prefix}-t2", f"{prefix}-t3"}
        assert {t.decode() for t in client.zrange(UNACKED_INDEX, 0, -1)} & set(tags) == left
    finally:
        for rt in reborn:
            rt.stop()
        client.delete(*every, Keys(prefix).worker("w2"))
        client.hdel(UNACKED, *tags)
        client.zrem(UNACKED_INDEX, *tags)
