"""The engines of one ``mmserve worker`` process and the plumbing around them.

The engines run on one asyncio loop in a background thread, exactly as in the gateway under
``local`` dispatch. Celery runs tasks on its thread pool; the generic engine-call task
(``workers.tasks``) hands each call to ``WorkerRuntime.execute``, which runs the engine method on
the loop and writes its reply into the call's Redis Stream (``workers.wire``). Alongside, the loop
publishes the heartbeat (load, models) and listens for aborts.

Other tasks running in a worker (batch jobs, pipelines) reach the engines through ``current()``:
``current().engines[name]`` and ``current().run(coro)`` (runs ``coro`` on the engine loop from a
Celery thread and returns its result).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from workers.celery_app import modality_queue, queue_keys, worker_queue
from workers.sweeper import DeadQueues
from workers.wire import END, ERROR, ITEM, START, STREAM_TTL_S, Call, Keys, dump, dump_error, restart_retry, slim

logger = logging.getLogger("mmserve.worker")
T = TypeVar("T")

_CURRENT: WorkerRuntime | None = None


def current() -> WorkerRuntime | None:
    """The runtime of this ``mmserve worker`` process (``None`` elsewhere)."""
    return _CURRENT


class WorkerRuntime:
    """Engines on an event loop thread, a heartbeat, abort handling, and ``execute`` for Celery."""

    def __init__(
        self,
        worker_id: str,
        modality: str,
        engines: dict[str, Any],
        redis_url: str,
        *,
        prefix: str = "mmserve",
        capacity: int = 8,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.worker_id, self.modality, self.engines = worker_id, modality, engines
        self.redis_url, self.keys, self.prefix = redis_url, Keys(prefix), prefix
        self.capacity, self.heartbeat_s = capacity, heartbeat_s
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mmserve-worker-loop", daemon=True)
        self._running: dict[str, concurrent.futures.Future[None]] = {}
        self._tasks = 0  # Celery tasks (jobs, chain stages) running on the loop: in-flight work too
        self._lock = threading.Lock()
        self._background: list[asyncio.Task[None]] = []
        self.redis: aioredis.Redis | None = None
        self.draining = False  # set when shutdown begins: finish running calls, take no new ones
        self._beat_lock = asyncio.Lock()

    # -- lifecycle (called from the main thread) --------------------------------------------------

    def start(self) -> None:
        """Start the loop, the engines, the heartbeat and the abort listener; become ``current()``."""
        global _CURRENT
        self._thread.start()
        self.run(self._astart())
        _CURRENT = self

    def stop(self) -> None:
        """Withdraw the heartbeat (the gateway stops routing here at once), stop the engines and
        stop being ``current()``: a stopped runtime's clients live on its dead loop."""
        global _CURRENT
        try:
            self.run(self._astop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if _CURRENT is self:
                _CURRENT = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the engine loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run_task(self, coro: Coroutine[Any, Any, T]) -> T:
        """``run`` for a Celery task's work (a job, a chain stage): counted in the heartbeat's
        ``inflight`` while it runs, as an engine call is."""
        with self._lock:
            self._tasks += 1
        try:
            return self.run(coro)
        finally:
            with self._lock:
                self._tasks -= 1

    async def _astart(self) -> None:
        self.redis = aioredis.Redis.from_url(
            self.redis_url,
            socket_timeout=5,
            socket_connect_timeout=2,
            **restart_retry(aio=True),
        )
        # Before the heartbeat is up: what a former worker of this id left (it was killed) goes.
        try:
            await DeadQueues(self.redis, self.prefix).forget_former_life(self.worker_id)
        except (redis.exceptions.RedisError, OSError) as exc:  # (the gateways' sweeper may still do it)
            logger.warning("could not remove what a former worker %s left: %r", self.worker_id, exc)
        for engine in self.engines.values():
            if hasattr(engine, "start"):
                await engine.start()
        self._background = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._control_loop()),
        ]

    async def _astop(self) -> None:
        for task in self._background:
            task.cancel()
        try:
            assert self.redis is not None
            # This worker's own queue (and its Celery bindings) is consumed by no one after it: the
            # calls left in it never started, and the gateway resubmits those elsewhere.
            queue = worker_queue(self.worker_id, self.prefix)
            await self.redis.delete(self.keys.worker(self.worker_id), *queue_keys(queue))
        except Exception:  # noqa: BLE001 - Redis may be down; the key expires anyway
            logger.warning("could not withdraw the heartbeat")
        for engine in self.engines.values():
            if hasattr(engine, "shutdown"):
                try:
                    await asyncio.wait_for(engine.shutdown(), timeout=30)
                except Exception:  # noqa: BLE001 - keep stopping the others
                    logger.exception("engine shutdown failed")

    # -- calls (Celery threads) -----------------------------------------------------------------

    def execute(self, call: Call) -> None:
        """Run ``call`` on its engine, replying through its stream; returns when it is done or aborted."""
        future = asyncio.run_coroutine_threadsafe(self._execute(call), self.loop)
        with self._lock:
            self._running[call.call_id] = future
        try:
            future.result()
        except concurrent.futures.CancelledError:
            logger.info("call %s aborted", call.call_id)
        finally:
            with self._lock:
                self._running.pop(call.call_id, None)

    async def _execute(self, call: Call) -> None:
        assert self.redis is not None
        r, key = self.redis, self.keys.stream(call.call_id)
        if await r.exists(self.keys.abort(call.call_id)):
            return  # the caller gave up before we started
        await r.xadd(key, {"k": START, "d": self.worker_id.encode()})
        await r.expire(key, STREAM_TTL_S)
        # Later entries never create the stream: once the caller left and deleted it, a re-created
        # key would have no TTL and outlive the call.
        add = functools.partial(r.xadd, key, nomkstream=True)
        agen = None
        try:
            engine = self.engines.get(call.engine)
            if engine is None:
                raise LookupError(f"worker {self.worker_id} does not serve {call.engine!r}")
            if call.method.startswith("_"):
                raise AttributeError(f"{call.method!r} is not a public engine method")
            result = getattr(engine, call.method)(*call.args, **call.kwargs)
            if hasattr(result, "__aiter__"):
                agen = result
                first = True
                async for item in agen:
                    await add({"k": ITEM, "d": dump(slim(item, first))})
                    first = False
                result = None
            elif asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                result = await result
            await add({"k": END, "d": dump(result)})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            await add({"k": ERROR, "d": dump_error(exc)})
        finally:
            if agen is not None and hasattr(agen, "aclose"):
                await agen.aclose()  # aborts the engine request when we stopped early

    def _abort(self, call_id: str) -> None:
        with self._lock:
            future = self._running.get(call_id)
        if future is not None:
            future.cancel()

    # -- background (engine loop) ---------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        """The heartbeat payload: identity, capacity, in-flight calls and per-engine stats."""
        stats: dict[str, dict[str, float]] = {}
        for name, engine in self.engines.items():
            try:
                stats[name] = {k: float(v) for k, v in engine.stats().items()}
            except Exception:  # noqa: BLE001 - a stats failure must not stop the heartbeat
                stats[name] = {}
        kv = max((s.get("kv_cache_usage", 0.0) for s in stats.values()), default=0.0)
        with self._lock:
            inflight = len(self._running) + self._tasks
        return {
            "worker_id": self.worker_id,
            "modality": self.modality,
            "models": list(self.engines),
            "capacity": self.capacity,
            "draining": self.draining,
            "inflight": inflight,
            "kv_usage": kv,
            "stats": stats,
            "ts": time.time(),
        }

    def drain(self) -> None:
        """Shutdown begins: take no new calls, and say so in a heartbeat now, not a period later
        (the gateway stops routing here and resubmits the calls sent here that have not started)."""
        self.draining = True
        with contextlib.suppress(Exception):  # (Redis down: the next heartbeat or the TTL says it)
            self.run(self._beat(), timeout=2)

    async def _beat(self) -> None:
        assert self.redis is not None
        queues = [worker_queue(self.worker_id, self.prefix), modality_queue(self.modality, self.prefix)]
        async with self._beat_lock:  # (one at a time: a drain's beat is never overwritten by an older one)
            depths = await asyncio.gather(*(self.redis.llen(q) for q in queues))
            data = self.load()
            data["queue_depth"] = int(sum(depths))
            await self.redis.set(
                self.keys.worker(self.worker_id), json.dumps(data), px=max(1000, int(self.heartbeat_s * 3000))
            )

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down: keep trying
                logger.warning("heartbeat failed: %r", exc)
            await asyncio.sleep(self.heartbeat_s)

    async def _control_loop(self) -> None:
        assert self.redis is not None
        channel = self.keys.control(self.worker_id)
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(channel)
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None:
                        self._abort(msg["data"].decode())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down: resubscribe later
                logger.warning("abort listener failed: %r", exc)
                await asyncio.sleep(self.heartbeat_s)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001
                    pass
