"""Job state in Redis (the celery runner): the ``Backend`` of ``workers.jobs.state`` on Redis keys,
with WATCH/MULTI transactions for the transitions and a Redis Stream per job for its events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from workers.jobs.state import TERMINAL, Record, Transition, is_terminal_event


class RedisBackend:
    """Job state in Redis under ``prefix`` (celery runner): ``<prefix>:job:<id>`` (JSON),
    ``<prefix>:idem:<key>``, ``<prefix>:events:<id>`` (stream), ``<prefix>:running`` (set),
    ``<prefix>:queued`` (sorted set: last dispatch time),
    ``<prefix>:meta:<key>``, ``<prefix>:index:<name>`` (sorted sets). Finished jobs, their events, idempotency
    keys and file metadata expire after ``ttl_s`` (the retention TTL: ``JobsConfig.result_ttl_s``)."""

    def __init__(self, redis_url: str, prefix: str = "mmserve:jobs", ttl_s: float = 86400) -> None:
        import redis.asyncio as aioredis

        from workers.wire import restart_retry

        self.r = aioredis.Redis.from_url(
            redis_url, socket_timeout=5, socket_connect_timeout=2, **restart_retry(aio=True)
        )
        self.prefix = prefix
        self.ttl_s = max(1, int(ttl_s))

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def create(self, rec: Record) -> tuple[Record, bool]:
        key = rec.get("idempotency_key")
        # The record is written first, so whoever wins the idempotency key points at a complete record.
        await self.r.set(self._k("job", rec["id"]), json.dumps(rec))
        if key and not await self.r.set(self._k("idem", key), rec["id"], nx=True, ex=self.ttl_s):
            await self.r.delete(self._k("job", rec["id"]))
            existing_id = (await self.r.get(self._k("idem", key))).decode()
            existing = await self.get(existing_id)
            if existing is not None:
                return existing, False
        # queued only once the job is ours: a replay must not leave its discarded id counted as waiting
        await self.r.zadd(self._k("queued"), {rec["id"]: time.time()})
        return rec, True

    async def get(self, job_id: str) -> Record | None:
        raw = await self.r.get(self._k("job", job_id))
        return json.loads(raw) if raw else None

    async def find(self, idempotency_key: str) -> Record | None:
        job_id = await self.r.get(self._k("idem", idempotency_key))
        return await self.get(job_id.decode()) if job_id else None

    async def update(self, job_id: str, fn: Transition) -> tuple[Record | None, bool]:
        from redis.exceptions import WatchError

        key = self._k("job", job_id)
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        return None, False
                    rec = json.loads(raw)
                    new = fn(rec)
                    if new is None:
                        await pipe.unwatch()
                        return rec, False
                    pipe.multi()
                    pipe.set(key, json.dumps(new), keepttl=True)  # a finished record keeps its expiry
                    if new["status"] == "running":
                        pipe.sadd(self._k("running"), job_id)
                    else:
                        pipe.srem(self._k("running"), job_id)
                    if new["status"] == "queued" and new["token"] != rec["token"]:  # requeued: dispatched now
                        pipe.zadd(self._k("queued"), {job_id: time.time()})
                    elif new["status"] != "queued":
                        pipe.zrem(self._k("queued"), job_id)
                    if new["status"] in TERMINAL and rec["status"] not in TERMINAL:
                        pipe.expire(key, self.ttl_s)
                        pipe.expire(self._k("events", job_id), self.ttl_s)
                    await pipe.execute()
                    return new, True
                except WatchError:
                    continue

    async def add_event(self, job_id: str, event: dict[str, Any]) -> None:
        stream = self._k("events", job_id)
        await self.r.xadd(stream, {"data": json.dumps({**event, "ts": time.time()})}, maxlen=10000, approximate=True)
        if is_terminal_event(event):
            await self.r.expire(stream, self.ttl_s)

    async def events(self, job_id: str, after: str | None = None) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        cursor = after or "0-0"
        stream = self._k("events", job_id)
        while True:
            got = await self.r.xread({stream: cursor}, block=1000, count=100)
            if not got:
                rec = await self.get(job_id)
                if rec is None or rec["status"] in TERMINAL and not await self.r.exists(stream):
                    return  # expired, or finished without a readable log
                continue
            for entry_id, fields in got[0][1]:
                cursor = entry_id.decode()
                ev = json.loads(fields[b"data"])
                yield cursor, ev
                if is_terminal_event(ev):
                    return

    async def running_ids(self) -> list[str]:
        return [m.decode() for m in await self.r.smembers(self._k("running"))]

    async def queued_count(self) -> int:
        return int(await self.r.zcard(self._k("queued")))

    async def stale_queued(self, older_than_s: float) -> list[str]:
        key, now = self._k("queued"), time.time()
        out = []
        for member in await self.r.zrangebyscore(key, 0, now - older_than_s):
            if await self.r.zrem(key, member):  # only one process wins each job
                await self.r.zadd(key, {member: now})
                out.append(member.decode())
        return out

    async def put_meta(self, key: str, value: dict[str, Any]) -> None:
        await self.r.set(self._k("meta", key), json.dumps(value), ex=self.ttl_s)

    async def get_meta(self, key: str) -> dict[str, Any] | None:
        raw = await self.r.get(self._k("meta", key))
        return json.loads(raw) if raw else None

    async def delete_meta(self, key: str) -> bool:
        return bool(await self.r.delete(self._k("meta", key)))

    async def index_add(self, index: str, item_id: str) -> None:
        key = self._k("index", index)
        await self.r.zadd(key, {item_id: time.time()})
        await self.r.zremrangebyscore(key, 0, time.time() - self.ttl_s)  # entries outlive nothing they name

    async def index_list(self, index: str, limit: int, after: str | None = None) -> list[str] | None:
        key = self._k("index", index)
        rank = await self.r.zrevrank(key, after) if after is not None else None
        if after is not None and rank is None:
            return None
        start = rank + 1 if rank is not None else 0
        return [m.decode() for m in await self.r.zrevrange(key, start, start + limit - 1)]

    async def index_remove(self, index: str, item_id: str) -> None:
        await self.r.zrem(self._k("index", index), item_id)

    async def index_retire(self, index: str, item_id: str) -> None:
        return None  # (it ages out of the index with the TTL, as index_add trims)

    async def delete(self, job_id: str) -> None:
        rec = await self.get(job_id)
        keys = [self._k("job", job_id), self._k("events", job_id)]
        if rec is not None and rec.get("idempotency_key"):
            keys.append(self._k("idem", rec["idempotency_key"]))
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(*keys)
            pipe.srem(self._k("running"), job_id)
            pipe.zrem(self._k("queued"), job_id)
            await pipe.execute()

    async def expired(self, before: float) -> list[Record]:
        return []  # finished records expire after ttl_s by themselves

    async def active_ids(self) -> list[str]:
        queued = [m.decode() for m in await self.r.zrange(self._k("queued"), 0, -1)]
        return [*queued, *await self.running_ids()]

    async def close(self) -> None:
        await self.r.aclose()
