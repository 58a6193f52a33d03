"""Running jobs: one attempt in this process (``Executor``), and the two runners behind one interface.

- ``LocalRunner``: asyncio tasks in the gateway process, at most ``JobKind.concurrency`` jobs of a
  kind at once; state in memory.
- ``CeleryRunner``: the ``mmserve.jobs.run`` task on the kind's modality queue
  (``<queue prefix>.<modality>``, consumed by ``mmserve worker --modality <modality>``); state and
  events in Redis. The worker renews a lease on its running job; ``reap`` (run periodically by the
  gateway and by every worker that ran a job) requeues a job whose lease expired, up to
  ``max_attempts``, then fails it. Celery's own
  redelivery of a killed worker's unacked message (after the visibility timeout) is harmless: the
  message's attempt token is stale by then, so it does nothing.

``JobService`` (the API's entry point) validates and submits jobs, answers queries, cancels, and
runs the reaper.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import QueueFullError
from workers.jobs import state
from workers.jobs.registry import JobCancelled, JobContext, JobKind, ProgressEvent, get_job_kind
from workers.jobs.state import Backend, Record
from workers.jobs.store import Store, file_id, make_store

logger = logging.getLogger("mmserve.jobs")
TASK_NAME = "mmserve.jobs.run"


@dataclass
class JobsConfig:
    """Settings shared by the gateway and the workers (the workers get them with each task)."""

    dispatch: str = "local"  # "local" | "celery"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "mmserve:jobs"
    queue_prefix: str = "mmserve"
    store: dict[str, Any] | None = None  # a store spec (``make_store``); None: $MMSERVE_CACHE/results
    max_attempts: int = 3
    lease_s: float = 30.0
    reap_interval_s: float = 5.0
    redispatch_after_s: float = 120.0  # a job queued this long is sent again (duplicates are harmless)
    max_queued: int = 10_000  # admission control: more waiting jobs than this is a 429

    def task_config(self) -> dict[str, Any]:
        return {
            "redis_url": self.redis_url,
            "key_prefix": self.key_prefix,
            "queue_prefix": self.queue_prefix,
            "store": self.store,
            "lease_s": self.lease_s,
            "reap_interval_s": self.reap_interval_s,
            "redispatch_after_s": self.redispatch_after_s,
        }


class _RecordingStore:
    """The result store as a job sees it: every ``put`` is also listed in the job's ``files``."""

    def __init__(self, store: Store, job_id: str, record: Callable[[dict[str, Any]], None]) -> None:
        self._store, self._job_id, self._record = store, job_id, record

    def put(self, job_id: str, name: str, data: bytes, content_type: str) -> str:
        url = self._store.put(job_id, name, data, content_type)
        if job_id == self._job_id:
            self._record(
                {
                    "id": file_id(job_id, name),
                    "name": name,
                    "url": url,
                    "content_type": content_type,
                    "bytes": len(data),
                }
            )
        return url

    def get(self, job_id: str, name: str) -> tuple[bytes, str]:
        return self._store.get(job_id, name)

    def delete_job(self, job_id: str) -> None:
        self._store.delete_job(job_id)


class Executor:
    """Runs attempts of jobs in this process: claim, heartbeat, progress, result, cancel."""

    def __init__(
        self,
        backend: Backend,
        store: Store,
        engines: dict[str, Any],
        *,
        lease_s: float,
        aliases: dict[str, str] | None = None,
        redispatch: Callable[[Record], Awaitable[None]] | None = None,
    ) -> None:
        self.backend, self.store, self.engines, self.aliases = backend, store, engines, aliases or {}
        self.lease_s = lease_s
        self.redispatch = redispatch
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.active: dict[str, tuple[JobContext, asyncio.Task[Any]]] = {}

    def cancel_local(self, job_id: str) -> None:
        """Stop a job running here now (a sync ``run`` stops at its next ``check_cancelled``)."""
        if job_id in self.active:
            ctx, task = self.active[job_id]
            ctx.cancel_event.set()
            task.cancel()

    async def _finish(self, job_id: str, fn: state.Transition) -> Record | None:
        rec, changed = await self.backend.update(job_id, fn)
        if changed and rec is not None:
            await self.backend.add_event(job_id, state.status_event(rec))
            if rec["status"] == "queued" and self.redispatch is not None:
                await self.redispatch(rec)
        return rec

    async def execute(self, job_id: str, token: str) -> None:
        rec, claimed = await self.backend.update(job_id, state.claim(token, self.lease_s, self.worker))
        if not claimed or rec is None:
            return  # cancelled, already run, or a stale message
        await self.backend.add_event(job_id, state.status_event(rec))
        kind = get_job_kind(rec["kind"])
        if kind is None:
            await self._finish(
                job_id,
                state.finish(
                    token,
                    "failed",
                    error={
                        "message": f"job kind {rec['kind']!r} is not registered on worker {self.worker}",
                        "type": "server_error",
                    },
                ),
            )
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()

        def post(item: tuple[str, Any]) -> None:  # thread-safe: a sync run reports from its thread
            loop.call_soon_threadsafe(queue.put_nowait, item)

        ctx = JobContext(
            job_id=job_id,
            kind=rec["kind"],
            params=rec["params"],
            engines=self.engines,
            store=_RecordingStore(self.store, job_id, lambda info: post(("file", info))),
            aliases=self.aliases,
            attempt=rec["attempts"],
            wants_preview=bool(rec.get("wants_preview")),
            on_progress=lambda ev: post(("progress", ev)),
        )
        writer = asyncio.create_task(self._write_events(job_id, token, queue))
        work = asyncio.create_task(self._run(kind, ctx))
        self.active[job_id] = (ctx, work)
        beat = asyncio.create_task(self._heartbeat(job_id, token, ctx, work))
        outcome: state.Transition
        try:
            result = await work
            outcome = state.finish(token, "succeeded", result=result)
        except asyncio.CancelledError:
            if not ctx.cancelled:
                raise  # this process is shutting down: the lease expires and the job is retried
            outcome = state.finish(token, "cancelled")  # no-op when cancel() already recorded it
        except JobCancelled:
            outcome = state.finish(token, "cancelled")  # also when the job stopped itself as cancelled
        except Exception as exc:  # noqa: BLE001 - the job's failure is reported, not raised
            logger.warning("job %s (%s) attempt %d failed: %r", job_id, rec["kind"], rec["attempts"], exc)
            error = {"message": f"{type(exc).__name__}: {exc}", "type": "job_error"}
            outcome = (
                state.requeue_or_fail(token, error["message"], expired_only=False)
                if kind.retry_on_error
                else state.finish(token, "failed", error=error)
            )
        finally:
            beat.cancel()
            self.active.pop(job_id, None)
            queue.put_nowait(None)
            with contextlib.suppress(Exception):
                await writer
        await self._finish(job_id, outcome)

    async def _run(self, kind: JobKind, ctx: JobContext) -> Any:
        if kind.is_async:
            return await kind.run(ctx.params, ctx)  # type: ignore[misc]
        return await asyncio.to_thread(kind.run, ctx.params, ctx)

    async def _write_events(self, job_id: str, token: str, queue: asyncio.Queue[tuple[str, Any] | None]) -> None:
        """Apply progress and file records in the order the job reported them."""
        import base64

        while (item := await queue.get()) is not None:
            what, value = item
            try:
                if what == "file":
                    await self.backend.update(job_id, state.add_file(token, value))
                    continue
                ev: ProgressEvent = value
                await self.backend.update(job_id, state.set_progress(token, ev.step, ev.total))
                out: dict[str, Any] = {"type": "progress", "step": ev.step, "total": ev.total}
                if ev.preview is not None:
                    out["preview"] = base64.b64encode(ev.preview).decode()
                    out["preview_type"] = ev.preview_type
                await self.backend.add_event(job_id, out)
            except Exception:  # noqa: BLE001 - a lost progress event must not kill the job
                logger.exception("job %s: could not record %s", job_id, what)

    async def _heartbeat(self, job_id: str, token: str, ctx: JobContext, work: asyncio.Task[Any]) -> None:
        """Renew the lease; notice a cancel (or a lost lease) recorded by another process."""
        interval = min(self.lease_s / 3, 0.5)
        while True:
            await asyncio.sleep(interval)
            try:
                rec, _ = await self.backend.update(job_id, state.heartbeat(token, self.lease_s))
            except Exception as exc:  # noqa: BLE001 - Redis hiccup: try again; the lease is longer
                logger.warning("job %s: heartbeat failed: %r", job_id, exc)
                continue
            if rec is None or rec["status"] != "running" or rec["token"] != token:
                ctx.cancel_event.set()
                work.cancel()
                return


class LocalRunner:
    """Jobs as asyncio tasks of this process, bounded per kind."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        executor.redispatch = self.dispatch

    async def dispatch(self, rec: Record) -> None:
        kind = get_job_kind(rec["kind"])
        sem = self._sems.setdefault(rec["kind"], asyncio.Semaphore(kind.concurrency if kind else 1))

        async def go() -> None:
            async with sem:
                await self.executor.execute(rec["id"], rec["token"])

        task = asyncio.create_task(go())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel_local(self, job_id: str) -> None:
        self.executor.cancel_local(job_id)

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class CeleryRunner:
    """Jobs as Celery tasks on their modality's queue."""

    def __init__(self, cfg: JobsConfig) -> None:
        from workers.celery_app import make_celery

        self.cfg = cfg
        self.celery = make_celery(cfg.redis_url)

    async def dispatch(self, rec: Record) -> None:
        from workers.celery_app import modality_queue

        queue = modality_queue(rec["modality"], self.cfg.queue_prefix)
        await asyncio.to_thread(
            self.celery.send_task, TASK_NAME, args=[rec["id"], rec["token"], self.cfg.task_config()], queue=queue
        )

    def cancel_local(self, job_id: str) -> None:
        return None  # the worker's heartbeat sees the cancelled status within half a second

    async def shutdown(self) -> None:
        return None


class IdempotencyConflict(Exception):
    """An idempotency key reused with a different kind or params."""


class JobService:
    """Submit, query, cancel and stream jobs; owns the backend, the store and the runner."""

    def __init__(self, cfg: JobsConfig, engines: dict[str, Any], aliases: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.engines = engines
        self.store = make_store(cfg.store)
        self.backend: Backend
        if cfg.dispatch == "celery":
            from workers.jobs.redis_backend import RedisBackend

            self.backend = RedisBackend(cfg.redis_url, cfg.key_prefix)
            self.runner: LocalRunner | CeleryRunner = CeleryRunner(cfg)
        else:
            self.backend = state.MemoryBackend()
            self.runner = LocalRunner(Executor(self.backend, self.store, engines, lease_s=cfg.lease_s, aliases=aliases))
        self._reaper: asyncio.Task[None] | None = None

    def ensure_started(self) -> None:
        """Start the reaper (celery) on the running loop, once."""
        if self.cfg.dispatch == "celery" and self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever())

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await self.runner.shutdown()
        await self.backend.close()

    async def submit(
        self,
        kind_name: str,
        params: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        wants_preview: bool = False,
        id_prefix: str = "job",
        owner: str | None = None,
        charge: Callable[[str, float], Awaitable[Any]] | None = None,
        file_size: Callable[[str], Awaitable[int]] | None = None,
    ) -> tuple[Record, bool]:
        """Queue a job for ``owner`` (the tenant; idempotency keys are per owner). Raises ``KeyError``
        (unknown kind), ``ValueError`` (bad params), ``IdempotencyConflict``, ``QueueFullError`` (too many
        jobs waiting), ``ConnectionError``. ``charge(unit, amount)`` (``gateway.ratelimit.charge``
        bound to the request) takes the kind's ``cost`` once the params are valid; it is refunded
        when the job is not queued (errors, idempotent replays). ``file_size(file_id)`` checks the
        valid params' ``file_id`` (raising for a file the caller may not read) and returns its size,
        which the cost hook gets as ``file_bytes=`` when it takes it."""
        self.ensure_started()
        kind = get_job_kind(kind_name)
        if kind is None:
            raise KeyError(kind_name)
        if kind.validate is not None:
            params = kind.validate(params, self.engines)
        fid, file_bytes = params.get("file_id"), None
        if file_size is not None and isinstance(fid, str):
            file_bytes = await file_size(fid)
        if (waiting := await self.backend.queued_count()) >= self.cfg.max_queued:
            raise QueueFullError(waiting, retry_after_s=5.0)
        idem = f"{owner or ''}:{idempotency_key}" if idempotency_key else None
        ch = None
        # a replay costs nothing, so it must not be refused for budget either
        if charge is not None and kind.cost is not None and (idem is None or await self.backend.find(idem) is None):
            wants_size = file_bytes is not None and "file_bytes" in inspect.signature(kind.cost).parameters
            extra = {"file_bytes": file_bytes} if wants_size else {}
            ch = await charge(*kind.cost(params, self.engines, **extra))
        try:
            stored, created = await self._create(kind, params, idem, wants_preview, id_prefix, owner)
        except BaseException:
            if ch is not None:
                await ch.refund()
            raise
        if not created and ch is not None:
            await ch.refund()
        return stored, created

    async def _create(
        self,
        kind: JobKind,
        params: dict[str, Any],
        idem: str | None,
        wants_preview: bool,
        id_prefix: str,
        owner: str | None,
    ) -> tuple[Record, bool]:
        rec = state.new_record(
            state.new_id(id_prefix),
            kind.kind,
            kind.modality,
            params,
            max_attempts=self.cfg.max_attempts,
            wants_preview=wants_preview,
            idempotency_key=idem,
            owner=owner,
        )
        stored, created = await self.backend.create(rec)
        if not created:
            if stored["kind"] != kind.kind or stored["params"] != params:
                raise IdempotencyConflict(stored["id"])
            return stored, False
        await self.backend.add_event(stored["id"], state.status_event(stored))
        try:
            await self.runner.dispatch(stored)
        except Exception as exc:
            failed, _ = await self.backend.update(stored["id"], state.fail_queued(f"could not queue the job: {exc}"))
            if failed is not None:
                await self.backend.add_event(stored["id"], state.status_event(failed))
            raise ConnectionError(f"could not queue the job: {exc}") from exc
        return stored, True

    async def get(self, job_id: str) -> Record | None:
        self.ensure_started()
        return await self.backend.get(job_id)

    async def cancel(self, job_id: str) -> Record | None:
        rec, changed = await self.backend.update(job_id, state.cancel)
        if changed and rec is not None:
            await self.backend.add_event(job_id, state.status_event(rec))
            self.runner.cancel_local(job_id)
        return rec

    async def reap(self) -> list[str]:
        return await reap(self.backend, self.runner.dispatch, self.cfg.redispatch_after_s)

    async def _reap_forever(self) -> None:
        await reap_forever(self.backend, self.runner.dispatch, self.cfg.reap_interval_s, self.cfg.redispatch_after_s)


async def reap(
    backend: Backend, dispatch: Callable[[Record], Awaitable[None]], redispatch_after_s: float = 120.0
) -> list[str]:
    """Requeue (or fail, after ``max_attempts``) running jobs whose lease expired, and send again
    jobs queued longer than ``redispatch_after_s`` (their message may have died with a worker that
    had reserved it; a duplicate message finds the job claimed and does nothing); the ids touched.
    Safe to run in several processes at once: each transition is atomic, so only one acts."""
    touched = []
    for job_id in await backend.stale_queued(redispatch_after_s):
        rec = await backend.get(job_id)
        if rec is not None and rec["status"] == "queued":
            touched.append(job_id)
            await dispatch(rec)
    for job_id in await backend.running_ids():
        fn = state.requeue_or_fail(None, "the worker running the job was lost (lease expired)", expired_only=True)
        rec, changed = await backend.update(job_id, fn)
        if not changed or rec is None:
            continue
        touched.append(job_id)
        logger.warning("job %s: lease expired -> %s", job_id, rec["status"])
        await backend.add_event(job_id, state.status_event(rec))
        if rec["status"] == "queued":
            await dispatch(rec)
    return touched


async def reap_forever(
    backend: Backend, dispatch: Callable[[Record], Awaitable[None]], interval_s: float, redispatch_after_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await reap(backend, dispatch, redispatch_after_s)
        except Exception as exc:  # noqa: BLE001 - Redis down: try again later
            logger.warning("job reaper failed: %r", exc)
