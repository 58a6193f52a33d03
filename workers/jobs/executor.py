"""One attempt of a job in this process (``Executor``): claim it, run its kind, renew the lease,
record progress and files in order, and move it to its outcome (succeeded, cancelled, failed, or
requeued for another attempt). Both runners use it: the local runner in the gateway, the Celery
task on a worker (``workers.jobs.tasks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.errors import error_object, failure_error, is_input_error
from workers.jobs import state
from workers.jobs.registry import JobCancelled, JobContext, JobKind, ProgressEvent, get_job_kind
from workers.jobs.state import Backend, Record
from workers.jobs.store import Store, file_id

logger = logging.getLogger("mmserve.jobs")


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
            _stop(*self.active[job_id])

    async def _finish(self, job_id: str, fn: state.Transition) -> Record | None:
        moved = False  # whether ``fn`` changed the status (not so a result kept after a cancel)

        def tracked(rec: Record) -> Record | None:
            nonlocal moved
            new = fn(rec)
            moved = new is not None and new["status"] != rec["status"]
            return new

        rec, _ = await self.backend.update(job_id, tracked)
        if moved and rec is not None:
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
                    error=error_object(
                        f"job kind {rec['kind']!r} is not registered on worker {self.worker}", "server_error"
                    ),
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
        except JobCancelled as exc:  # also when the job stopped itself as cancelled
            outcome = state.finish(token, "cancelled", result=exc.result)
        except Exception as exc:  # noqa: BLE001 - the job's failure is reported, not raised
            logger.warning("job %s (%s) attempt %d failed: %r", job_id, rec["kind"], rec["attempts"], exc)
            error = failure_error(exc, internal_type="job_error")
            outcome = (
                state.requeue_or_fail(token, error["message"], expired_only=False)
                if kind.retry_on_error and not is_input_error(exc)
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
                    rec, _ = await self.backend.update(job_id, state.add_file(token, value))
                    if rec is None:  # the job was deleted (cancelled, then deleted as it ran): keep nothing
                        await asyncio.to_thread(self.store.delete_job, job_id)
                    continue
                ev: ProgressEvent = value
                await self.backend.update(job_id, state.set_progress(token, ev.step, ev.total, ev.detail))
                out: dict[str, Any] = {"type": "progress", "step": ev.step, "total": ev.total}
                if ev.detail is not None:
                    out["detail"] = ev.detail
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
                _stop(ctx, work, lost=rec is None or rec["status"] != "cancelled" or rec["token"] != token)
                return


def _stop(ctx: JobContext, work: asyncio.Task[Any], lost: bool = False) -> None:
    """Stop a job's attempt, once (a job keeping its partial result goes on after the first);
    ``lost``: another attempt took the job over, or its record went (it keeps nothing)."""
    if not ctx.cancel_event.is_set():
        ctx.lost = lost
        ctx.cancel_event.set()
        work.cancel()
