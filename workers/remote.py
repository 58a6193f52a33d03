"""Gateway side of ``--dispatch celery``: the live-worker view and remote engine calls.

``Cluster.call`` sends one engine method call to a chosen worker's queue as a Celery task and
reads the reply from the call's Redis Stream. Faults:

- the worker stops heartbeating (killed, hung loop, graceful exit) before anything was streamed:
  the call is resubmitted to another live worker (``max_attempts`` in all);
- it stops after items were streamed: a 503 ``worker_lost`` error (an SSE error event when the
  response is already streaming);
- Redis unreachable: every call fails at once with a 503 (short socket timeouts), and the view
  recovers by itself when Redis is back;
- the caller leaves early (client disconnect): the call is aborted on the worker;
- a worker died without stopping: what it left in Redis (its queue, bindings, taken calls) is
  removed ``sweep_grace_s`` after its heartbeat expired (``workers.sweeper``);
- the worker refuses it at its bound of requests held (``HeldBoundError``, before any work): it
  goes to another live worker not yet tried; only when none is left is the refusal (the soonest
  ``Retry-After``) the caller's 429.

``RemoteEngine`` is the generic proxy: ``run(req)`` and ``stream(req)`` (and any other method via
``call``/``stream_call``) forward to the same-named engine on a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from engine.admission import HeldBoundError
from gateway.errors import APIError
from workers.celery_app import DEFAULT_PREFIX, make_celery, worker_queue
from workers.routing import WorkerLoad, choose_worker
from workers.sweeper import DeadQueues
from workers.tasks import ENGINE_CALL
from workers.wire import END, ERROR, ITEM, START, Call, Keys, load, load_error, redis_where, restart_retry

logger = logging.getLogger("mmserve.dispatch")
LOST, DRAINING = "lost", "draining"  # why a call goes to another worker (``Cluster._lost``)


def broker_down(exc: BaseException) -> APIError:
    return APIError(
        503,
        f"the cluster broker (Redis) is unreachable: {exc}",
        code="broker_unavailable",
        headers={"Retry-After": "1"},
    )


class Cluster:
    """Redis connections, the live-worker view (refreshed every ``refresh_s``) and remote calls."""

    def __init__(
        self,
        redis_url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        refresh_s: float = 0.5,
        poll_s: float = 0.5,
        socket_timeout_s: float = 2.0,
        max_attempts: int = 3,
        start_timeout_s: float = 3.0,
        max_queue_wait_s: float = 60.0,
        sweep_s: float = 30.0,
        sweep_grace_s: float = 300.0,
    ) -> None:
        self.redis_url, self.prefix, self.keys = redis_url, prefix, Keys(prefix)
        self.refresh_s, self.poll_s, self.max_attempts = refresh_s, poll_s, max_attempts
        self.socket_timeout_s = socket_timeout_s
        self.start_timeout_s, self.max_queue_wait_s = start_timeout_s, max_queue_wait_s
        self.sweep_s, self.sweep_grace_s = sweep_s, sweep_grace_s
        self.celery = make_celery(redis_url, socket_timeout_s=socket_timeout_s)
        self.redis: aioredis.Redis | None = None
        self.workers: dict[str, WorkerLoad] = {}
        self.redis_ok = False
        self.local_inflight: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()  # per model: calls resubmitted after their worker was lost
        self._refresher: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._cleanup: set[asyncio.Task[None]] = set()
        self._users = 0

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start the view refresher and the dead workers' sweeper (idempotent: every
        proxy calls it)."""
        self._users += 1
        if self._refresher is None:
            self.redis = aioredis.Redis.from_url(
                self.redis_url,
                socket_timeout=self.poll_s + self.socket_timeout_s,
                socket_connect_timeout=self.socket_timeout_s,
                **restart_retry(aio=True),
            )
            await self.refresh()
            if not self.redis_ok:  # (later failures are logged as they happen)
                logger.warning(
                    "Redis at %s is unreachable: calls get 503 until it answers", redis_where(self.redis_url)
                )
            self._refresher = asyncio.create_task(self._refresh_loop())
            dead = DeadQueues(self.redis, self.prefix, self.sweep_grace_s)
            self._sweeper = asyncio.create_task(dead.run(self.sweep_s))

    async def shutdown(self) -> None:
        self._users -= 1
        if self._users > 0 or self._refresher is None:
            return
        self._refresher.cancel()
        self._refresher = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._cleanup:
            await asyncio.wait(self._cleanup, timeout=2)
        if self.redis is not None:
            await self.redis.aclose()

    async def refresh(self) -> None:
        """Re-read every worker's heartbeat (a missing key is a dead worker). Redis counts as down
        after two failed reads in a row (one may hit a connection left stale by a Redis restart)."""
        assert self.redis is not None
        values: list[Any] = []
        for attempt in (1, 2):
            try:
                keys = [k async for k in self.redis.scan_iter(match=self.keys.worker_pattern, count=500)]
                values = await self.redis.mget(keys) if keys else []
                break
            except (redis.exceptions.RedisError, OSError) as exc:
                if attempt == 2:
                    if self.redis_ok:
                        logger.warning("Redis unreachable: %s: %s", type(exc).__name__, exc)
                    self.redis_ok, self.workers = False, {}
                    return
        workers = {}
        for value in values:
            if value is None:
                continue
            try:
                w = WorkerLoad.from_heartbeat(json.loads(value))
            except (ValueError, KeyError, TypeError):
                continue
            workers[w.worker_id] = w
        if not self.redis_ok:
            logger.info("Redis reachable; %d live workers", len(workers))
        self.redis_ok, self.workers = True, workers

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    # -- queries --------------------------------------------------------------------------------

    def live(self, model: str) -> list[WorkerLoad]:
        """Live workers serving ``model`` and taking new calls (as of the last refresh)."""
        live = [w for w in self.workers.values() if model in w.models and not w.draining]
        for w in live:  # this gateway's own count is current; the heartbeat's is up to a period old
            w.local_inflight = self.local_inflight[w.worker_id]
        return live

    def model_stats(self, model: str) -> dict[str, float]:
        """Engine stats of ``model`` summed over its live workers (rates averaged), plus the count."""
        workers = self.live(model)
        total: dict[str, float] = {
            "num_workers": float(len(workers)),
            "dispatch_retries_total": float(self.retries[model]),
        }
        for w in workers:
            for k, v in w.stats.get(model, {}).items():
                total[k] = total.get(k, 0.0) + v
        for k in ("kv_cache_usage", "prefix_cache_hit_rate"):
            if k in total and workers:
                total[k] /= len(workers)
        return total

    # -- calls ----------------------------------------------------------------------------------

    async def call(
        self,
        model: str,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        key: str | None = None,
        pin: str | None = None,
    ) -> AsyncIterator[tuple[bytes, Any]]:
        """``(START, worker_id)`` when a worker takes the call (again after a retry), ``(ITEM,
        chunk)`` per streamed chunk, then ``(END, return value)``. ``key`` is the prefix-affinity
        key (``workers.routing.prefix_key``); ``pin`` names the only worker allowed (no retries).
        Worker errors are re-raised as themselves."""
        if not self.redis_ok or self.redis is None:
            raise broker_down(ConnectionError("no connection"))
        tried: set[str] = set()
        refusals: list[HeldBoundError] = []
        lost = 0
        while lost < (1 if pin else self.max_attempts):
            live = [w for w in self.live(model) if pin is None or w.worker_id == pin]
            worker = choose_worker(live, key, exclude=tried)
            if worker is None:
                if refusals:
                    raise _all_full(model, refusals)  # every worker left was full: the client retries later
                if tried:
                    raise APIError(
                        503, f"every worker serving {model!r} was lost during the request", code="worker_lost"
                    )
                raise APIError(503, f"no live worker serves {model!r}", code="no_workers", headers={"Retry-After": "1"})
            tried.add(worker.worker_id)
            call = Call(uuid.uuid4().hex, model, method, args, kwargs or {})
            gone: str | None = None  # why the call left this worker before it streamed (``_lost``)
            try:
                async with contextlib.aclosing(self._call_on(worker.worker_id, call)) as replies:
                    async for kind, value in replies:
                        if kind is None:  # the worker died (or is shutting down) before anything was streamed
                            gone = value
                            break
                        yield kind, value
                        if kind == END:
                            return
            except HeldBoundError as exc:  # refused before any work (the view's loads are a heartbeat old)
                refusals.append(exc)
                continue  # (not a lost worker: it does not use up an attempt)
            if gone == DRAINING:
                continue  # (nor is one shutting down: another worker takes the call, it finishes its own)
            logger.warning("worker %s lost before replying to a %s call; retrying elsewhere", worker.worker_id, model)
            self.workers.pop(worker.worker_id, None)
            self.retries[model] += 1
            lost += 1
        if refusals:
            raise _all_full(model, refusals)
        raise APIError(503, f"{model!r}: {self.max_attempts} workers were lost during the request", code="worker_lost")

    async def _call_on(self, worker_id: str, call: Call) -> AsyncIterator[tuple[bytes | None, Any]]:
        """One attempt on one worker; yields ``(None, None)`` when it is lost before any item."""
        assert self.redis is not None
        stream = self.keys.stream(call.call_id)
        done = False
        self.local_inflight[worker_id] += 1
        try:
            try:
                await asyncio.to_thread(
                    self.celery.send_task, ENGINE_CALL, args=[call], queue=worker_queue(worker_id, self.prefix)
                )
            except Exception as exc:  # kombu wraps the connection error in its own types
                raise broker_down(exc) from exc
            last, streamed, started, sent_at = "0-0", False, False, time.time()
            while True:
                try:
                    reply = await self.redis.xread({stream: last}, count=256, block=int(self.poll_s * 1000))
                    beat = None if reply else await self.redis.get(self.keys.worker(worker_id))
                except (redis.exceptions.RedisError, OSError) as exc:
                    raise broker_down(exc) from exc
                if not reply:
                    lost = self._lost(worker_id, beat, started, sent_at)
                    if lost and streamed:
                        raise APIError(
                            503, f"worker {worker_id} was lost mid-request; the reply is incomplete", code="worker_lost"
                        )
                    if lost:
                        yield None, lost  # retry elsewhere; ``finally`` aborts this call in case it surfaces
                        return
                for _stream, entries in reply or []:
                    for entry_id, fields in entries:
                        last = entry_id
                        kind = fields[b"k"]
                        if kind == ITEM:
                            streamed = True
                            yield ITEM, load(fields[b"d"])
                        elif kind == END:
                            done = True
                            yield END, load(fields[b"d"])
                            return
                        elif kind == ERROR:
                            done = True
                            error = load_error(fields[b"d"])
                            if isinstance(error, (redis.exceptions.RedisError, OSError)):
                                raise broker_down(error) from error  # the worker lost Redis mid-call
                            raise error
                        elif kind == START:
                            started = True
                            yield START, worker_id
                        else:
                            logger.warning("unknown stream entry %r", kind)
        finally:
            self.local_inflight[worker_id] -= 1
            self._spawn(self._finish(worker_id, call.call_id, aborted=not done))

    def _lost(self, worker_id: str, beat: bytes | None, started: bool, sent_at: float) -> str | None:
        """Why a call that has been silent for a poll period is to go elsewhere (None: it waits on):
        its worker's heartbeat expired (``LOST``); the call never started and the worker is shutting
        down (``DRAINING``: at once, it starts nothing more); or it never started although a
        heartbeat taken a while after sending it shows free slots and an empty queue (``LOST``: the
        message vanished, e.g. Redis restarted without persistence). A call still queued behind
        busy slots after ``max_queue_wait_s`` is a 503."""
        if beat is None:
            return LOST
        if started:
            return None
        try:
            data = json.loads(beat)
            load_now = WorkerLoad.from_heartbeat(data)
            fresh = float(data.get("ts", 0.0)) > sent_at + 1.0
        except (ValueError, KeyError, TypeError):
            return None
        if load_now.draining:
            logger.info("call on %s never started and the worker is shutting down: resubmitting", worker_id)
            return DRAINING
        waited_s = time.time() - sent_at
        if waited_s < self.start_timeout_s:
            return None
        if fresh and load_now.queue_depth == 0 and load_now.inflight < load_now.capacity:
            logger.warning("call on %s never started although the worker is idle: resubmitting", worker_id)
            return LOST
        if waited_s > self.max_queue_wait_s:
            raise APIError(
                503,
                f"worker {worker_id} did not pick the request up within {self.max_queue_wait_s:.0f}s",
                code="queue_timeout",
                headers={"Retry-After": "1"},
            )
        return None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _finish(self, worker_id: str, call_id: str, aborted: bool) -> None:
        """Drop the reply stream; when the caller left early, abort the call on the worker."""
        assert self.redis is not None
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                if aborted:
                    pipe.set(self.keys.abort(call_id), b"1", ex=3600)
                    pipe.publish(self.keys.control(worker_id), call_id.encode())
                pipe.delete(self.keys.stream(call_id))
                await pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            logger.warning("could not clean up call %s: %r", call_id, exc)


def _all_full(model: str, refusals: list[HeldBoundError]) -> HeldBoundError:
    """The caller's 429 once every worker tried refused: the requests they hold together, and the
    soonest of their ``Retry-After``s."""
    if len(refusals) == 1:
        return refusals[0]
    held = sum(getattr(r, "num_waiting", 0) for r in refusals)  # (a refusal from an older worker lacks it)
    retry = min(r.retry_after_s for r in refusals)
    return HeldBoundError(held, retry, f"in progress on the {len(refusals)} workers serving {model!r}")


class RemoteEngine:
    """The generic proxy of an engine served by workers: same name, calls forwarded."""

    def __init__(self, cluster: Cluster, name: str, modality: str) -> None:
        self.cluster, self.model_name, self.modality = cluster, name, modality

    async def start(self) -> None:
        await self.cluster.start()

    async def shutdown(self) -> None:
        await self.cluster.shutdown()

    def stats(self) -> dict[str, float]:
        return self.cluster.model_stats(self.model_name)

    async def call(self, method: str, *args: Any, key: str | None = None, **kwargs: Any) -> Any:
        """The return value of ``await engine.<method>(*args, **kwargs)`` on a worker."""
        result = None
        async for kind, value in self.cluster.call(self.model_name, method, args, kwargs, key=key):
            if kind == END:
                result = value
        return result

    async def stream_call(self, method: str, *args: Any, key: str | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        """The items of ``async for item in engine.<method>(*args, **kwargs)`` on a worker; closing
        this iterator early aborts the call there at once (not when the garbage collector runs)."""
        replies = self.cluster.call(self.model_name, method, args, kwargs, key=key)
        async with contextlib.aclosing(replies):
            async for kind, value in replies:
                if kind == ITEM:
                    yield value

    async def run(self, req: Any) -> Any:
        return await self.call("run", req)

    def stream(self, req: Any) -> AsyncIterator[Any]:
        return self.stream_call("stream", req)
