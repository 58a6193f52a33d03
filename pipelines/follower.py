"""Following an ``audio.pipeline`` chain under Celery from the job that sent it.

The job (on an ASR worker) sends the stage chain and watches its ``meta`` hash in the stage store
(``pipelines.stage_store.StageStore``) until it ends. Celery cannot be trusted to bring every task
back: with ``acks_late`` on Redis, the task of a SIGKILLed worker returns only after the
visibility timeout (an hour), and a next stage whose publishing failed never comes. So the
follower sends the chain again, as a new dispatch whose number makes the earlier tasks no-ops
(``StageStore.live``), when

- a stage is under way on a worker whose heartbeat is gone (the lost attempt counts: one past
  ``max_attempts`` fails the chain naming the worker), or
- nothing of the current dispatch is under way and the next stage's queue has been empty for
  ``STALL_S`` (a task lost between two stages; a stage waiting for a busy engine's capacity is
  under way until ``STALL_S`` after it was due to be tried again: its retried task is held by a
  worker until then, not on the queue).

A retried job takes the chain over (``follower`` in the hash names the attempt following it): it
sends the chain again unless a stage is under way on a live worker. An attempt that finds itself
superseded stops following, and only the current follower marks the chain cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import reported_error
from pipelines.chain import celery_chain
from pipelines.stage_store import ChainOptions, Progress, StageStore, no_progress

logger = logging.getLogger("mmserve.pipelines")

CHECK_S = 1.0  # how often the chain's workers and queues are checked
LIVE_TTL_S = 5.0  # how long one reading of the live workers' modalities serves every follower
STALL_S = 10.0  # nothing under way and nothing queued for this long: the next stage's task was lost
ENDED = (b"succeeded", b"failed")

# Cancel the chain only for the attempt following it, and never once it has ended.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if redis.call('HGET', KEYS[1], 'follower') ~= ARGV[1] or not status or status == 'succeeded' or status == 'failed' then
  return 0
end
redis.call('HSET', KEYS[1], 'status', 'cancelled')
return 1
"""


@functools.cache
def celery_app(redis_url: str) -> Any:
    """One Celery app per process (and Redis URL) sends every job's chain."""
    from workers.celery_app import make_celery

    return make_celery(redis_url)


_LIVE: dict[str, tuple[float, set[str]]] = {}  # prefix -> (when read, modalities): shared by the followers


async def live_modalities(redis: Any, prefix: str) -> set[str]:
    """The modalities live workers (not draining) of ``prefix`` serve, read from their
    heartbeats at most every ``LIVE_TTL_S`` per process (a SCAN walks the whole keyspace)."""
    from workers.wire import Keys

    read_at, served = _LIVE.get(prefix, (-LIVE_TTL_S, set()))
    if time.monotonic() - read_at < LIVE_TTL_S:
        return served
    keys = [k async for k in redis.scan_iter(match=Keys(prefix).worker_pattern, count=1000)]
    served = set()
    for raw in await redis.mget(keys) if keys else []:
        try:
            beat = json.loads(raw) if raw is not None else {}
        except ValueError:
            continue
        if isinstance(beat, dict) and beat.get("modality") and not beat.get("draining"):
            served.add(str(beat["modality"]))
    _LIVE[prefix] = (time.monotonic(), served)
    return served


class Superseded(RuntimeError):
    """A newer attempt of the job follows the chain now."""


def running(meta: dict[bytes, bytes]) -> tuple[str, str] | None:
    """``(stage, worker)`` of the stage of the current dispatch under way, from the chain's
    ``meta`` hash (None: none is)."""
    stage = StageStore.under_way(meta, "running")
    where = meta.get(f"{stage}.where".encode()) if stage is not None else None
    return None if stage is None or where is None else (stage, where.decode())


def waiting(meta: dict[bytes, bytes]) -> bool:
    """Whether the current dispatch's stage waits for a busy engine's capacity (its task is to be
    tried again), from the chain's ``meta`` hash: until ``STALL_S`` after it was due."""
    stage = StageStore.under_way(meta, "waiting")
    due = meta.get(f"{stage}.due".encode()) if stage is not None else None
    return due is not None and time.time() < float(due) + STALL_S  # (the worker's clock: wall time)


@dataclass
class ChainFollower:
    """Sends the chain ``chain_id`` (its stages on ``rt``'s cluster) and follows it to its end,
    reporting its ``progress``. ``rt``: the worker runtime (``redis``, an async client;
    ``redis_url``; ``prefix``)."""

    rt: Any
    store: StageStore
    chain_id: str
    opts: ChainOptions
    progress: Progress = no_progress
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    _reported: tuple[int, dict[str, Any]] = field(default=(-1, {}), init=False)

    async def follow(self, check_cancelled: Callable[[], None]) -> None:
        """Until the chain ends; raises if it failed (``RuntimeError``), when a newer attempt of
        the job took it over (``Superseded``), or what ``check_cancelled`` raises (the chain is
        then marked cancelled: its queued stages become no-ops)."""
        redis, key = self.rt.redis, self.store.meta_key(self.chain_id)
        await redis.hset(key, "follower", self.token)
        meta = await redis.hgetall(key)
        if meta.get(b"status") not in ENDED:
            if lost := await self._lost(meta):
                await self._send_again(meta, *lost)
            elif running(meta) is None:
                await self._send()
        seen, since = None, time.monotonic()
        self._report(meta)
        next_check = time.monotonic() + CHECK_S
        try:  # the worker's async client: polling never blocks the engine loop
            while (status := await redis.hget(key, "status")) is not None and status not in ENDED:
                check_cancelled()
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + CHECK_S
                    meta = await redis.hgetall(key)
                    if meta.get(b"follower") != self.token.encode():
                        raise Superseded(f"chain {self.chain_id} is followed by a newer attempt of its job")
                    done = self.store.stages_done(meta, self.opts)
                    if (state := (meta.get(b"status"), meta.get(b"dispatch"), done)) != seen:
                        seen, since = state, time.monotonic()
                    waiting = await self._no_worker(meta) if time.monotonic() - since > 2 * CHECK_S else None
                    self._report(meta, waiting)
                    await self._check(meta, since)
                await asyncio.sleep(0.05)
        except BaseException:
            self.store.r.eval(_CANCEL, 1, key, self.token)
            raise
        if status != b"succeeded":
            failure = await asyncio.to_thread(self.store.failure, self.chain_id)
            if failure is not None and (error := reported_error(failure)) is not None:  # as a local chain reports it
                raise error
            state = await asyncio.to_thread(self.store.status, self.chain_id)
            raise RuntimeError(f"pipeline failed: {state and state['error']}")
        self._report(await redis.hgetall(key))

    def _report(self, meta: dict[bytes, bytes], waiting: str | None = None) -> None:
        """Report progress when it changed: the stages done, their attempts, workers and seconds,
        and ``waiting_for_worker`` (the modality of the next stage, when no live worker serves
        it: its task waits on the queue until one starts)."""
        detail = self.store.progress_detail(meta, self.opts)
        if waiting is not None:
            detail["waiting_for_worker"] = waiting
        total = len(self.opts.stages())
        done = total if meta.get(b"status") == b"succeeded" else self.store.stages_done(meta, self.opts)
        if (done, detail) == self._reported:
            return
        if waiting is not None and self._reported[1].get("waiting_for_worker") != waiting:
            logger.warning(
                "chain %s: its %s stage waits: no live worker serves %s", self.chain_id, detail["stage"], waiting
            )
        self._reported = (done, detail)
        self.progress(done, total, detail=detail)

    async def _no_worker(self, meta: dict[bytes, bytes]) -> str | None:
        """The next stage's modality if no stage is under way and no live worker (not draining)
        serves it; else None (also when Redis cannot tell: the hint is not worth failing for)."""
        stage = self.store.next_stage(meta, self.opts)
        if stage is None or running(meta) is not None:
            return None
        try:
            served = await live_modalities(self.rt.redis, self.rt.prefix)
        except Exception as exc:  # noqa: BLE001 - a Redis hiccup
            logger.debug("chain %s: could not read the workers' heartbeats: %r", self.chain_id, exc)
            return None
        return None if stage.modality in served else stage.modality

    async def _check(self, meta: dict[bytes, bytes], since: float) -> None:
        """Send the chain again if its stage's worker was lost, or its next stage's task."""
        if lost := await self._lost(meta):
            await self._send_again(meta, *lost)
        elif (
            running(meta) is None
            and time.monotonic() - since > STALL_S
            and not waiting(meta)
            and not await self._queued(meta)
        ):
            logger.warning(
                "chain %s: no stage under way or queued for %.0f s; sending it again", self.chain_id, STALL_S
            )
            await self._send()

    async def _lost(self, meta: dict[bytes, bytes]) -> tuple[str, str] | None:
        """``(stage, worker)`` of the stage under way if its worker's heartbeat is gone (it
        expires 3 periods after the last one)."""
        from workers.wire import Keys

        under_way = running(meta)
        if under_way is None or await self.rt.redis.exists(Keys(self.rt.prefix).worker(under_way[1])):
            return None
        return under_way

    async def _queued(self, meta: dict[bytes, bytes]) -> int:
        """Tasks waiting on the queue of the chain's next stage not done (0: none is left)."""
        from workers.celery_app import modality_queue

        stage = self.store.next_stage(meta, self.opts)
        return int(await self.rt.redis.llen(modality_queue(stage.modality, self.rt.prefix))) if stage else 0

    async def _send(self) -> None:
        """Send the chain's stages as a new dispatch (the tasks of earlier ones become no-ops;
        done stages are skipped)."""
        dispatch = await asyncio.to_thread(self.store.redispatch, self.chain_id)
        app = celery_app(self.rt.redis_url)  # (the job has the chain's result: Celery keeps none)
        chain = celery_chain(app, self.chain_id, self.opts, self.rt.prefix, dispatch, keep_result=False)
        await asyncio.to_thread(chain.apply_async)

    async def _send_again(self, meta: dict[bytes, bytes], stage: str, worker: str) -> None:
        """The chain after ``stage``'s ``worker`` was lost: sent again, or failed if that was
        the stage's last attempt."""
        if int(meta.get(f"{stage}.attempts".encode(), 0)) >= self.opts.max_attempts:
            error = f"{stage}: worker {worker} was lost"
            await asyncio.to_thread(self.store.set_status, self.chain_id, "failed", error)
            return
        logger.warning("chain %s: worker %s of stage %s was lost; sending it again", self.chain_id, worker, stage)
        await self._send()
