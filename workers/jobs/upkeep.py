"""Periodic job bookkeeping, safe to run in several processes at once (each transition is atomic,
each deletion idempotent):

- the reaper (``reap``) retries or fails jobs whose worker was lost and sends again jobs whose
  message may have been lost;
- the retention sweep (``sweep``) deletes finished jobs and files older than the retention TTL.
  ``delete_job`` and ``delete_upload`` are also what the API's DELETE routes do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from workers.jobs import state
from workers.jobs.state import TERMINAL, Backend, Record
from workers.jobs.store import UPLOADS, Store, check_name

logger = logging.getLogger("mmserve.jobs")


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


async def delete_job(backend: Backend, store: Store, rec: Record, expired: bool = True) -> None:
    """Delete a job's result files, then its record and events (a failure leaves the record, so
    the deletion can be tried again). A batch's place in its listing goes when it ``expired``;
    one a client deletes stays a cursor (``Backend.index_retire``)."""
    await asyncio.to_thread(store.delete_job, rec["id"])
    if rec["kind"].startswith("batch:"):
        drop = backend.index_remove if expired else backend.index_retire
        await drop(state.batches_index(rec.get("owner")), rec["id"])
    await backend.delete(rec["id"])
    await asyncio.to_thread(store.delete_job, rec["id"])  # a file its attempt put meanwhile


async def delete_upload(
    backend: Backend, store: Store, fid: str, meta: dict[str, Any] | None, expired: bool = True
) -> None:
    """Delete an uploaded (or generated) file and its metadata (its listing place as ``delete_job``'s)."""
    await asyncio.to_thread(store.delete, UPLOADS, fid)
    if meta is not None:
        drop = backend.index_remove if expired else backend.index_retire
        await drop(state.files_index(meta.get("owner")), fid)
    await backend.delete_meta(f"file:{fid}")


def _file_ids(params: dict[str, Any]) -> set[str]:
    return {v for k in ("file_id", "input_file_id") if isinstance(v := params.get(k), str)}


async def uploads_in_use(backend: Backend) -> dict[str, str]:
    """The uploaded files that queued and running jobs read: file id -> one such job's id."""
    out: dict[str, str] = {}
    for job_id in await backend.active_ids():
        if (rec := await backend.get(job_id)) is not None:
            for fid in _file_ids(rec["params"]):
                out.setdefault(fid, job_id)
    return out


async def sweep(backend: Backend, store: Store, ttl_s: float, now: float | None = None) -> list[str]:
    """Delete what outlived the retention ``ttl_s`` (seconds): jobs that finished over ``ttl_s``
    ago (record, events and files), files of jobs no longer on record, and uploaded or generated
    files older than ``ttl_s``. Never touched: anything of a queued or running job (its input file
    included), a job that finished within ``ttl_s``, a file written within ``ttl_s``. Returns the
    job and file ids deleted."""
    cutoff = (time.time() if now is None else now) - ttl_s
    gone: list[str] = []
    for rec in await backend.expired(cutoff):
        await delete_job(backend, store, rec)
        gone.append(rec["id"])
    newest: dict[tuple[str, str], float] = {}  # (job id, "") or (UPLOADS, file id) -> last write
    for job_id, name, mtime in await asyncio.to_thread(lambda: list(store.entries())):
        key = (job_id, name if job_id == UPLOADS else "")
        newest[key] = max(newest.get(key, 0.0), mtime)
    in_use = await uploads_in_use(backend)
    for (job_id, fid), written in newest.items():
        if written >= cutoff or fid in in_use:
            continue
        try:
            check_name(fid or job_id)
        except ValueError:
            continue  # not ours (a half-written file's temporary name, a stray directory)
        if fid:
            meta = await backend.get_meta(f"file:{fid}")
            if meta is None or meta.get("created_at", 0) < cutoff:
                await delete_upload(backend, store, fid, meta)
                gone.append(fid)
            continue
        rec = await backend.get(job_id)
        if rec is None:
            await asyncio.to_thread(store.delete_job, job_id)
        elif rec["status"] in TERMINAL and rec["finished_at"] < cutoff:
            await delete_job(backend, store, rec)
        else:
            continue
        gone.append(job_id)
    if gone:
        logger.info("retention sweep: deleted %d expired job(s) and file(s)", len(gone))
    return gone


async def sweep_forever(backend: Backend, store: Store, ttl_s: float, interval_s: float) -> None:
    while True:
        try:
            await sweep(backend, store, ttl_s)
        except Exception as exc:  # noqa: BLE001 - the store or Redis down: try again later
            logger.warning("retention sweep failed: %r", exc)
        await asyncio.sleep(interval_s)
