"""What a worker that died without stopping (SIGKILL, out of memory, a lost machine) left in Redis.

A worker that stops deletes its own queue and that queue's Celery binding
(``WorkerRuntime._astop``); one that dies leaves them, with the calls still in the queue (the
gateway resubmitted those elsewhere once the heartbeat expired) and, in Celery's ``unacked``
hash, the calls it had taken: after the visibility timeout Celery would put those back on the
dead queue, where nobody consumes them. With workers that come and go, each death left a few keys
for good. ``DeadQueues.sweep`` removes them once a worker's heartbeat has been gone for
``grace_s``: long past the point where every call on it went elsewhere, and long enough that a
Redis restart (heartbeats gone for a period) touches nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from workers.celery_app import worker_queue
from workers.wire import Keys

logger = logging.getLogger("mmserve.dispatch")

BINDING = "_kombu.binding."  # kombu's Redis transport: a queue's binding set
UNACKED, UNACKED_INDEX = "unacked", "unacked_index"  # kombu's taken-not-acknowledged messages


@dataclass
class DeadQueues:
    """Sweeps the own queues of ``prefix``'s workers whose heartbeat is gone for ``grace_s``
    (``redis``: an asyncio client). Call ``sweep`` now and then; it is idempotent, and several
    gateways may sweep at once."""

    redis: Any
    prefix: str
    grace_s: float = 300.0
    _dead_since: dict[str, float] = field(default_factory=dict)  # worker id -> first seen dead

    async def sweep(self) -> list[str]:
        """Remove the queue, binding and unacked calls of each worker dead for ``grace_s``;
        returns their worker ids."""
        head = BINDING + worker_queue("", self.prefix)
        bound = [k.decode()[len(head) :] async for k in self.redis.scan_iter(match=head + "*", count=500)]
        if not bound:
            self._dead_since.clear()
            return []
        keys = Keys(self.prefix)
        alive = [await self.redis.exists(keys.worker(w)) for w in bound]
        now = time.monotonic()
        self._dead_since = {w: self._dead_since.get(w, now) for w, up in zip(bound, alive, strict=True) if not up}
        due = [w for w, since in self._dead_since.items() if now - since >= self.grace_s]
        for worker_id in due:
            await self._remove(worker_id)
            del self._dead_since[worker_id]
        return due

    async def _remove(self, worker_id: str) -> None:
        queue = worker_queue(worker_id, self.prefix)
        tags = []
        async for tag, raw in self.redis.hscan_iter(UNACKED, count=500):
            try:
                routing_key = json.loads(raw)[2]
            except (ValueError, IndexError, TypeError):
                continue
            if routing_key == queue:
                tags.append(tag)
        async with self.redis.pipeline(transaction=True) as pipe:
            if tags:
                pipe.hdel(UNACKED, *tags).zrem(UNACKED_INDEX, *tags)
            pipe.delete(queue, BINDING + queue)
            await pipe.execute()
        logger.warning(
            "worker %s died without stopping: removed its queue and %d calls it had taken", worker_id, len(tags)
        )
