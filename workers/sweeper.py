"""What a worker that died without stopping (SIGKILL, out of memory, a lost machine) left in Redis.

A worker that stops deletes its own queue and that queue's Celery bindings
(``WorkerRuntime._astop``); one that dies leaves them, with the calls still in the queue (the
gateway resubmitted those elsewhere once the heartbeat expired) and, in Celery's ``unacked``
hash, the calls it had taken: after the visibility timeout Celery would put those back on the
dead queue, where nobody consumes them. With workers that come and go, each death left keys for
good. ``DeadQueues`` removes them once a worker's heartbeat has been gone for ``grace_s``: long
past the point where every call on it went elsewhere, and long enough that a Redis restart
(heartbeats gone for a period) touches nothing. A worker restarted under the same
``--worker-id`` within the grace removes them itself as it starts (``forget_former_life``),
before its heartbeat is up: the calls its former life had taken would otherwise come back on its
queue after the visibility timeout and run again, long after the gateway resubmitted them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import redis.exceptions

from workers.celery_app import binding_key, queue_keys, worker_queue
from workers.wire import Keys

logger = logging.getLogger("mmserve.dispatch")

UNACKED, UNACKED_INDEX = "unacked", "unacked_index"  # kombu's taken-not-acknowledged messages


def _glob(text: str) -> str:
    """``text`` as a literal in a Redis match pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@dataclass
class DeadQueues:
    """Sweeps the own queues of ``prefix``'s workers whose heartbeat is gone for ``grace_s``.
    ``sweep`` is idempotent, and several gateways may sweep at once."""

    redis: aioredis.Redis
    prefix: str
    grace_s: float = 300.0
    _dead_since: dict[str, float] = field(default_factory=dict)  # worker id -> first seen dead

    async def run(self, every_s: float) -> None:
        """``sweep`` every ``every_s`` until cancelled; a failed sweep is logged, the next one runs."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep()
            except (redis.exceptions.RedisError, OSError) as exc:  # Redis down: the view says so
                logger.debug("could not sweep dead workers' queues: %r", exc)
            except Exception:  # noqa: BLE001 - a bug here must not stop the sweeps
                logger.exception("sweeping dead workers' queues failed")

    async def sweep(self) -> list[str]:
        """Remove the queue, bindings and unacked calls of each worker dead for ``grace_s``;
        returns their worker ids."""
        head = binding_key(worker_queue("", self.prefix))  # (a declared worker queue's binding set)
        pattern = _glob(head) + "*"
        bound = [k.decode()[len(head) :] async for k in self.redis.scan_iter(match=pattern, count=500)]
        async with self.redis.pipeline(transaction=False) as pipe:  # (one round trip for them all)
            for w in bound:
                pipe.exists(Keys(self.prefix).worker(w))
            alive = await pipe.execute()
        now = time.monotonic()
        self._dead_since = {w: self._dead_since.get(w, now) for w, up in zip(bound, alive, strict=True) if not up}
        due = {worker_queue(w, self.prefix): w for w, since in self._dead_since.items() if now - since >= self.grace_s}
        if not due:
            return []
        taken = await self._taken(list(due))
        swept = [w for q, w in due.items() if await self._remove(w, q, taken[q])]
        for w in due.values():
            self._dead_since.pop(w, None)
        return swept

    async def forget_former_life(self, worker_id: str) -> bool:
        """For a worker starting under ``worker_id``, before its heartbeat is up: remove what an
        earlier worker of that id left (its queue, bindings and unacked calls), unless that one
        is still alive (a heartbeat: two workers given one id; nothing is touched)."""
        queue = worker_queue(worker_id, self.prefix)
        return await self._remove(worker_id, queue, (await self._taken([queue]))[queue])

    async def _taken(self, queues: list[str]) -> dict[str, list[bytes]]:
        """The tags of the unacked calls routed to each of ``queues`` (one scan for them all)."""
        taken: dict[str, list[bytes]] = {q: [] for q in queues}
        async for tag, raw in self.redis.hscan_iter(UNACKED, count=500):
            try:
                routing_key = json.loads(raw)[2]  # [message, exchange, routing key]
            except (ValueError, IndexError, TypeError):
                continue
            if routing_key in taken:
                taken[routing_key].append(tag)
        return taken

    async def _remove(self, worker_id: str, queue: str, tags: list[bytes]) -> bool:
        """Delete ``queue``'s keys and its ``tags`` in one transaction, unless the worker's
        heartbeat came back meanwhile (a worker restarted under its id keeps its queue)."""
        beat = Keys(self.prefix).worker(worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(beat)
                if await pipe.exists(beat):
                    return False
                pipe.multi()
                pipe.delete(*queue_keys(queue))
                if tags:
                    pipe.hdel(UNACKED, *tags).zrem(UNACKED_INDEX, *tags)
                removed = (await pipe.execute())[0]
            except redis.exceptions.WatchError:
                return False
        if removed or tags:  # (a worker that stopped cleanly left nothing)
            logger.warning(
                "worker %s died without stopping: removed its queue and %d calls it had taken", worker_id, len(tags)
            )
        return True
