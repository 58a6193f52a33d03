"""Running jobs: the two runners behind one interface, and the service the API calls.

- ``LocalRunner``: asyncio tasks in the gateway process, at most ``JobKind.concurrency`` jobs of a
  kind at once; state in memory.
- ``CeleryRunner``: the ``mmserve.jobs.run`` task on the kind's modality queue
  (``<queue prefix>.<modality>``, consumed by ``mmserve worker --modality <modality>``); state and
  events in Redis. The worker renews a lease on its running job; ``reap`` (run periodically by the
  gateway and by every worker that ran a job) requeues a job whose lease expired, up to
  ``max_attempts``, then fails it. Celery's own
  redelivery of a killed worker's unacked message (after the visibility timeout) is harmless: the
  message's attempt token is stale by then, so it does nothing.

``JobService`` (the API's entry point) validates and submits jobs, answers queries, cancels,
deletes, and runs the reaper and the retention sweep (``workers.jobs.upkeep``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import QueueFullError
from gateway.metrics import plugin_modality
from workers.jobs import state
from workers.jobs.executor import Executor
from workers.jobs.registry import JobKind, get_job_kind
from workers.jobs.state import Backend, Record
from workers.jobs.store import make_store
from workers.jobs.upkeep import delete_job, reap, reap_forever, sweep, sweep_forever

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
    # retention: a finished job's record and files, and an uploaded or generated file, are kept
    # this long (from the end of the job, from the upload); the sweep runs every sweep_interval_s
    result_ttl_s: float = 24 * 3600.0
    sweep_interval_s: float = 600.0

    def task_config(self) -> dict[str, Any]:
        return {
            "redis_url": self.redis_url,
            "key_prefix": self.key_prefix,
            "queue_prefix": self.queue_prefix,
            "store": self.store,
            "result_ttl_s": self.result_ttl_s,
            "lease_s": self.lease_s,
            "reap_interval_s": self.reap_interval_s,
            "redispatch_after_s": self.redispatch_after_s,
        }


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


class KindNotServed(LookupError):
    """A job kind whose modality this server serves no engine of (``--only`` left it out, or no
    model of it was given or found): its job would wait on its queue for a worker no gateway call
    goes to (celery) or fail (local)."""

    def __init__(self, modality: str) -> None:
        super().__init__(modality)
        self.modality = modality


class JobService:
    """Submit, query, cancel and stream jobs; owns the backend, the store and the runner."""

    def __init__(self, cfg: JobsConfig, engines: dict[str, Any], aliases: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.engines, self.aliases = engines, aliases or {}
        self.modalities = {plugin_modality(e) for e in engines.values()}  # what submit accepts
        self.store = make_store(cfg.store)
        self.backend: Backend
        if cfg.dispatch == "celery":
            from workers.jobs.redis_backend import RedisBackend

            self.backend = RedisBackend(cfg.redis_url, cfg.key_prefix, cfg.result_ttl_s)
            self.runner: LocalRunner | CeleryRunner = CeleryRunner(cfg)
        else:
            self.backend = state.MemoryBackend()
            self.runner = LocalRunner(Executor(self.backend, self.store, engines, lease_s=cfg.lease_s, aliases=aliases))
        self._upkeep: list[asyncio.Task[None]] = []

    def ensure_started(self) -> None:
        """Start the retention sweep and (celery) the reaper on the running loop, once."""
        if self._upkeep:
            return
        cfg = self.cfg
        self._upkeep.append(
            asyncio.create_task(sweep_forever(self.backend, self.store, cfg.result_ttl_s, cfg.sweep_interval_s))
        )
        if cfg.dispatch == "celery":
            self._upkeep.append(
                asyncio.create_task(
                    reap_forever(self.backend, self.runner.dispatch, cfg.reap_interval_s, cfg.redispatch_after_s)
                )
            )

    async def shutdown(self) -> None:
        for task in self._upkeep:
            task.cancel()
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
        (unknown kind), ``KindNotServed`` (the kind's modality has no engine here; a service with
        none at all serves no kind), ``ValueError`` (bad params), ``IdempotencyConflict``,
        ``QueueFullError`` (too many jobs waiting), ``ConnectionError``. ``charge(unit, amount)`` (``gateway.ratelimit.charge``
        bound to the request) takes the kind's ``cost`` once the params are valid; it is refunded
        when the job is not queued (errors, idempotent replays). ``file_size(file_id)`` checks the
        valid params' ``file_id`` (raising for a file the caller may not read) and returns its size,
        which the cost hook gets as ``file_bytes=`` when it takes it."""
        self.ensure_started()
        kind = get_job_kind(kind_name)
        if kind is None:
            raise KeyError(kind_name)
        if kind.modality not in self.modalities:
            raise KindNotServed(kind.modality)
        if kind.validate is not None:
            takes_aliases = "aliases" in inspect.signature(kind.validate).parameters  # model-name resolvers
            try:
                params = kind.validate(params, self.engines, **({"aliases": self.aliases} if takes_aliases else {}))
            except Exception as exc:
                _name_in_params(exc)
                raise
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

    async def delete(self, rec: Record) -> None:
        """Delete a finished job: what its kind keeps of it elsewhere (``JobKind.forget``), its
        result files, record and events."""
        kind = get_job_kind(rec["kind"])
        if kind is not None and kind.forget is not None:
            await asyncio.to_thread(kind.forget, rec["id"], self.cfg)
        await delete_job(self.backend, self.store, rec, expired=False)

    async def reap(self) -> list[str]:
        return await reap(self.backend, self.runner.dispatch, self.cfg.redispatch_after_s)

    async def sweep(self, now: float | None = None) -> list[str]:
        """One retention sweep (``workers.jobs.upkeep.sweep``); ``now`` for tests."""
        return await sweep(self.backend, self.store, self.cfg.result_ttl_s, now)


def _name_in_params(exc: BaseException) -> None:
    """A validate hook reuses the synchronous routes' resolvers, whose errors name a body field
    (``param="voice"``); in a job that field is ``params.voice``."""
    param = getattr(exc, "param", None)
    if isinstance(param, str) and param != "params" and not param.startswith("params."):
        exc.param = f"params.{param}"  # type: ignore[attr-defined]
