"""Job state: records, their transitions, and where they live (memory for the local runner, Redis
for celery).

A job record is a JSON-serialisable dict (see ``new_record``). Every change goes through a pure
transition function ``fn(record) -> new record | None`` applied atomically by the backend
(``update``): in memory trivially, in Redis with WATCH/MULTI on the record key, so the gateway's
reaper, the worker's heartbeat and a client's cancel never overwrite each other. Each attempt has a
``token``: a worker only moves a job it claimed with the current token, so a stale (redelivered or
requeued) Celery message does nothing.

Events (status changes, progress) are an ordered log per job: a list in memory, a Redis Stream
(``<prefix>:events:<id>``) in Redis (``workers.jobs.redis_backend``). ``events(id, after)`` yields them from a cursor and ends after
the terminal status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from gateway.errors import error_object

Record = dict[str, Any]
Transition = Callable[[Record], "Record | None"]

TERMINAL = ("succeeded", "failed", "cancelled")
STATUSES = ("queued", "running", *TERMINAL)


def files_index(owner: str | None) -> str:
    """The listing (``Backend.index_*``) of a tenant's uploaded files."""
    return f"files:{owner or ''}"


def batches_index(owner: str | None) -> str:
    """The listing of a tenant's batches."""
    return f"batches:{owner or ''}"


def new_id(prefix: str = "job") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def new_record(
    job_id: str,
    kind: str,
    modality: str,
    params: dict[str, Any],
    *,
    max_attempts: int,
    wants_preview: bool = False,
    idempotency_key: str | None = None,
    owner: str | None = None,
) -> Record:
    return {
        "id": job_id,
        "object": "job",
        "kind": kind,
        "modality": modality,
        "status": "queued",
        "params": params,
        "idempotency_key": idempotency_key,
        "created_at": time.time(),
        "started_at": None,
        "finished_at": None,
        "attempts": 0,
        "max_attempts": max_attempts,
        "progress": {"step": 0, "total": 0},
        "result": None,
        "files": [],
        "error": None,
        "wants_preview": wants_preview,
        "token": uuid.uuid4().hex,
        "lease_until": None,
        "worker": None,
        "owner": owner,
    }


# -- transitions (pure: return the new record, or None for "no change") --------------------------


def claim(token: str, lease_s: float, worker: str) -> Transition:
    """queued with this token -> running (attempt + 1, lease taken)."""

    def fn(rec: Record) -> Record | None:
        if rec["status"] != "queued" or rec["token"] != token:
            return None
        now = time.time()
        return {
            **rec,
            "status": "running",
            "attempts": rec["attempts"] + 1,
            "started_at": rec["started_at"] or now,
            "lease_until": now + lease_s,
            "worker": worker,
            "error": None,
        }

    return fn


def _mine(rec: Record, token: str) -> bool:
    return rec["status"] == "running" and rec["token"] == token


def _cancelled_attempt(rec: Record, token: str) -> bool:
    """The attempt ``token`` ran when the job was cancelled (it may still keep what it finished)."""
    return rec["status"] == "cancelled" and rec["token"] == token


def heartbeat(token: str, lease_s: float) -> Transition:
    return lambda rec: {**rec, "lease_until": time.time() + lease_s} if _mine(rec, token) else None


def set_progress(token: str, step: int, total: int, detail: dict[str, Any] | None = None) -> Transition:
    progress = {"step": step, "total": total, **({"detail": detail} if detail is not None else {})}
    return lambda rec: {**rec, "progress": progress} if _mine(rec, token) else None


def add_file(token: str, info: dict[str, Any]) -> Transition:
    """A file the attempt ``token`` put (also after its job was cancelled: a partial result's)."""

    def fn(rec: Record) -> Record | None:
        if not (_mine(rec, token) or _cancelled_attempt(rec, token)):
            return None
        files = [f for f in rec["files"] if f["name"] != info["name"]]
        return {**rec, "files": [*files, info]}

    return fn


def finish(token: str, status: str, *, result: Any = None, error: dict[str, Any] | None = None) -> Transition:
    """running (this attempt) -> a terminal status; an attempt cancelled meanwhile keeps a
    ``result`` it ends with (``JobCancelled.result``, or all of it when it finished as the
    cancel came), and stays cancelled."""
    assert status in TERMINAL

    def fn(rec: Record) -> Record | None:
        if status in ("cancelled", "succeeded") and _cancelled_attempt(rec, token):  # cancel() came first
            return None if result is None else {**rec, "result": result}
        if not _mine(rec, token):
            return None
        return {
            **rec,
            "status": status,
            "result": result,
            "error": error,
            "finished_at": time.time(),
            "lease_until": None,
        }

    return fn


def requeue_or_fail(token: str | None, reason: str, *, expired_only: bool) -> Transition:
    """A lost or failed attempt: back to queued under a fresh token while attempts remain, else
    failed. ``expired_only``: only when the lease ran out (the reaper), whatever the token."""

    def fn(rec: Record) -> Record | None:
        if rec["status"] != "running":
            return None
        if expired_only and (rec["lease_until"] or 0) >= time.time():
            return None
        if token is not None and rec["token"] != token:
            return None
        if rec["attempts"] < rec["max_attempts"]:
            return {
                **rec,
                "status": "queued",
                "token": uuid.uuid4().hex,
                "lease_until": None,
                "worker": None,
                "error": error_object(reason, "retried"),
            }
        msg = f"{reason} (gave up after {rec['attempts']} attempt{'s' if rec['attempts'] != 1 else ''})"
        return {
            **rec,
            "status": "failed",
            "error": error_object(msg, "worker_lost"),
            "finished_at": time.time(),
            "lease_until": None,
        }

    return fn


def remove_file(name: str) -> Transition:
    """A finished job's output ``name`` deleted (``DELETE /v1/files/{id}``)."""

    def fn(rec: Record) -> Record | None:
        if rec["status"] not in TERMINAL or all(f["name"] != name for f in rec["files"]):
            return None
        return {**rec, "files": [f for f in rec["files"] if f["name"] != name]}

    return fn


def fail_queued(message: str) -> Transition:
    """queued -> failed (the job could not be queued)."""

    def fn(rec: Record) -> Record | None:
        if rec["status"] != "queued":
            return None
        return {
            **rec,
            "status": "failed",
            "error": error_object(message, "queue_error"),
            "finished_at": time.time(),
        }

    return fn


def cancel(rec: Record) -> Record | None:
    if rec["status"] in TERMINAL:
        return None
    return {**rec, "status": "cancelled", "finished_at": time.time(), "lease_until": None}


def status_event(rec: Record) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "status", "status": rec["status"], "attempts": rec["attempts"]}
    if rec.get("error"):
        ev["error"] = rec["error"]
    return ev


# -- backends -------------------------------------------------------------------------------------


class Backend(Protocol):
    async def create(self, rec: Record) -> tuple[Record, bool]:
        """Store ``rec``; with an ``idempotency_key`` already used, the existing record and ``False``."""
        ...

    async def get(self, job_id: str) -> Record | None: ...

    async def find(self, idempotency_key: str) -> Record | None:
        """The job created with ``idempotency_key`` (as stored: ``<owner>:<key>``), if any."""
        ...

    async def update(self, job_id: str, fn: Transition) -> tuple[Record | None, bool]:
        """Apply ``fn`` atomically: ``(record after, changed)``; ``(None, False)`` for an unknown id."""
        ...

    async def add_event(self, job_id: str, event: dict[str, Any]) -> None: ...

    def events(self, job_id: str, after: str | None = None) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """``(cursor, event)`` from after ``after``; ends after a terminal status event."""
        ...

    async def running_ids(self) -> list[str]: ...

    async def queued_count(self) -> int: ...

    async def stale_queued(self, older_than_s: float) -> list[str]:
        """Queued jobs last dispatched over ``older_than_s`` ago, each handed to one caller only
        (which dispatches it again: a message may have been lost with a worker that reserved it)."""
        ...

    async def put_meta(self, key: str, value: dict[str, Any]) -> None: ...

    async def get_meta(self, key: str) -> dict[str, Any] | None: ...

    async def delete_meta(self, key: str) -> bool: ...

    async def index_add(self, index: str, item_id: str) -> None:
        """Remember ``item_id`` in the listing ``index`` (for ``GET /v1/batches``, ``/v1/files``)."""
        ...

    async def index_list(self, index: str, limit: int, after: str | None = None) -> list[str] | None:
        """Up to ``limit`` ids of ``index``, newest first, starting after the id ``after``; ``None``
        when ``after`` is not in it (a page restarted from the top would repeat what was read)."""
        ...

    async def index_remove(self, index: str, item_id: str) -> None: ...

    async def index_retire(self, index: str, item_id: str) -> None:
        """``item_id`` was deleted: listings skip it (its record or metadata is gone), but it stays
        a cursor for a while (Redis: until it ages out of the index; memory: the last
        ``max_finished`` retired), so a client that deletes what it pages through reads on."""
        ...

    async def delete(self, job_id: str) -> None:
        """Forget a job: its record, events and idempotency key (idempotent)."""
        ...

    async def expired(self, before: float) -> list[Record]:
        """Records of jobs that finished before ``before`` (epoch seconds) and stay until deleted;
        a backend whose records expire by themselves (Redis) returns ``[]``."""
        ...

    async def active_ids(self) -> list[str]:
        """The queued and running jobs."""
        ...

    async def close(self) -> None: ...


def is_terminal_event(ev: dict[str, Any]) -> bool:
    return ev.get("type") == "status" and ev.get("status") in TERMINAL


class MemoryBackend:
    """In-process state (local runner): lost with the process, which also runs the jobs. Only the
    ``max_finished`` most recently finished jobs are kept (and none past the retention sweep)."""

    def __init__(self, max_finished: int = 10_000) -> None:
        self.jobs: dict[str, Record] = {}
        self.idem: dict[str, str] = {}
        self.log: dict[str, list[dict[str, Any]]] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        self.indexes: dict[str, list[str]] = {}
        self.max_finished = max_finished
        self._finished: deque[str] = deque()
        self._retired: deque[tuple[str, str]] = deque()  # (index, id) deleted, still a cursor
        self._changed = asyncio.Condition()

    async def create(self, rec: Record) -> tuple[Record, bool]:
        key = rec.get("idempotency_key")
        if key and key in self.idem:
            return self.jobs[self.idem[key]], False
        if key:
            self.idem[key] = rec["id"]
        self.jobs[rec["id"]] = rec
        self.log[rec["id"]] = []
        return rec, True

    async def get(self, job_id: str) -> Record | None:
        return self.jobs.get(job_id)

    async def find(self, idempotency_key: str) -> Record | None:
        job_id = self.idem.get(idempotency_key)
        return self.jobs.get(job_id) if job_id is not None else None

    async def update(self, job_id: str, fn: Transition) -> tuple[Record | None, bool]:
        rec = self.jobs.get(job_id)
        if rec is None:
            return None, False
        new = fn(rec)
        if new is None:
            return rec, False
        self.jobs[job_id] = new
        if new["status"] in TERMINAL and rec["status"] not in TERMINAL:
            self._finished.append(job_id)
            while len(self._finished) > self.max_finished:
                self._forget(self._finished.popleft())
        return new, True

    def _forget(self, job_id: str) -> None:
        rec = self.jobs.pop(job_id, None)
        self.log.pop(job_id, None)
        if rec and rec.get("idempotency_key"):
            self.idem.pop(rec["idempotency_key"], None)

    async def delete(self, job_id: str) -> None:
        self._forget(job_id)
        with contextlib.suppress(ValueError):
            self._finished.remove(job_id)

    async def expired(self, before: float) -> list[Record]:
        return [rec for j in list(self._finished) if (rec := self.jobs[j])["finished_at"] < before]

    async def active_ids(self) -> list[str]:
        return [j for j, r in self.jobs.items() if r["status"] not in TERMINAL]

    async def add_event(self, job_id: str, event: dict[str, Any]) -> None:
        self.log.setdefault(job_id, []).append({**event, "ts": time.time()})
        async with self._changed:
            self._changed.notify_all()

    async def events(self, job_id: str, after: str | None = None) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        i = int(after) + 1 if after and after.isdigit() else 0
        while True:
            log = self.log.get(job_id, [])
            while i < len(log):
                ev = log[i]
                yield str(i), ev
                i += 1
                if is_terminal_event(ev):
                    return
            async with self._changed:
                if i >= len(self.log.get(job_id, [])):
                    await self._changed.wait()

    async def running_ids(self) -> list[str]:
        return [j for j, r in self.jobs.items() if r["status"] == "running"]

    async def stale_queued(self, older_than_s: float) -> list[str]:
        return []  # in-process dispatch is never lost

    async def queued_count(self) -> int:
        return sum(r["status"] == "queued" for r in self.jobs.values())

    async def put_meta(self, key: str, value: dict[str, Any]) -> None:
        self.meta[key] = value

    async def get_meta(self, key: str) -> dict[str, Any] | None:
        return self.meta.get(key)

    async def delete_meta(self, key: str) -> bool:
        return self.meta.pop(key, None) is not None

    async def index_add(self, index: str, item_id: str) -> None:
        self.indexes.setdefault(index, []).append(item_id)

    async def index_list(self, index: str, limit: int, after: str | None = None) -> list[str] | None:
        ids = self.indexes.get(index, [])[::-1]
        if after is not None and after not in ids:
            return None
        start = ids.index(after) + 1 if after is not None else 0
        return ids[start : start + limit]

    async def index_remove(self, index: str, item_id: str) -> None:
        with contextlib.suppress(ValueError):
            self.indexes.get(index, []).remove(item_id)

    async def index_retire(self, index: str, item_id: str) -> None:
        self._retired.append((index, item_id))
        while len(self._retired) > self.max_finished:
            await self.index_remove(*self._retired.popleft())

    async def close(self) -> None:
        return None
