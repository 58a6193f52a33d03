"""The Celery task that runs one attempt of a job on a worker (``mmserve.jobs.run``).

``mmserve worker`` imports this module (``workers.celery_app.TASK_MODULES``). The job runs on the
worker's engine loop (``workers.runtime.current()``) with that worker's engines; outside
``mmserve worker`` (a bare ``celery worker``) it runs on a private loop with no engines.
``MMSERVE_JOB_MODULES`` (comma list) names extra modules to import so that they register job kinds.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
from collections import Counter
from typing import Any

from celery import shared_task

from workers.jobs import state
from workers.jobs.executor import Executor
from workers.jobs.redis_backend import RedisBackend
from workers.jobs.runner import TASK_NAME
from workers.jobs.store import make_store
from workers.jobs.upkeep import reap_forever

for _module in filter(None, (m.strip() for m in os.environ.get("MMSERVE_JOB_MODULES", "").split(","))):
    importlib.import_module(_module)

_EXECUTORS: dict[tuple[int, str], tuple[Executor, asyncio.AbstractEventLoop]] = {}
_REAPERS: list[Any] = []  # keeps the reaper tasks referenced
_LOCK = threading.Lock()
_RUNNING: Counter[str] = Counter()  # jobs of each kind running in this process
BUSY_RETRY_S = 1.0  # a job past its kind's places here is offered again after this


def _load_plugins() -> None:
    """Job kinds are registered by the plugins (and batch kinds by ``workers.jobs.batch``)."""
    from gateway.plugins import load_plugins

    load_plugins()
    importlib.import_module("workers.jobs.batch")


def _private_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="mmserve-jobs-loop", daemon=True).start()
    return loop


def _executor(cfg: dict[str, Any], app: Any) -> tuple[Executor, asyncio.AbstractEventLoop]:
    """One executor per process and configuration, bound to the engine loop."""
    from workers import runtime

    key = (os.getpid(), repr(sorted(cfg.items(), key=lambda kv: kv[0])))
    with _LOCK:
        if key not in _EXECUTORS:
            _load_plugins()
            rt = runtime.current()
            loop = rt.loop if rt is not None else _private_loop()
            engines = rt.engines if rt is not None else {}
            backend = asyncio.run_coroutine_threadsafe(_backend(cfg), loop).result()

            async def redispatch(rec: state.Record) -> None:
                from workers.celery_app import modality_queue

                queue = modality_queue(rec["modality"], cfg["queue_prefix"])
                await asyncio.to_thread(app.send_task, TASK_NAME, args=[rec["id"], rec["token"], cfg], queue=queue)

            executor = Executor(
                backend, make_store(cfg["store"]), engines, lease_s=cfg["lease_s"], redispatch=redispatch
            )
            # workers reap too, so a dead worker's job is retried even while no gateway runs
            interval, again = cfg.get("reap_interval_s", cfg["lease_s"]), cfg.get("redispatch_after_s", 120.0)
            _REAPERS.append(asyncio.run_coroutine_threadsafe(reap_forever(backend, redispatch, interval, again), loop))
            _EXECUTORS[key] = (executor, loop)
        return _EXECUTORS[key]


async def _backend(cfg: dict[str, Any]) -> RedisBackend:
    # created on the loop that uses it; finished records expire after the gateway's retention TTL
    return RedisBackend(cfg["redis_url"], cfg["key_prefix"], cfg.get("result_ttl_s", 86400.0))


def _take_slot(kind: str, limit: int) -> bool:
    """One of ``limit`` places of ``kind`` in this process (``_free_slot`` gives it back)."""
    with _LOCK:
        if _RUNNING[kind] >= limit:
            return False
        _RUNNING[kind] += 1
        return True


def _free_slot(kind: str) -> None:
    with _LOCK:
        _RUNNING[kind] -= 1


@shared_task(name=TASK_NAME, bind=True, ignore_result=True)  # (the job store has its outcome)
def run_job(self: Any, job_id: str, token: str, cfg: dict[str, Any]) -> None:
    """Run the attempt ``token`` of ``job_id``; a stale or cancelled attempt returns at once.

    At most the kind's ``concurrency`` jobs of a kind run at once in a worker, and at most half
    its Celery threads: the rest stay for engine calls and for the stage tasks an
    ``audio.pipeline`` job sends to its own queue (followers holding every thread would wait on
    stages no thread is left to run). A job past that goes back to the queue for a moment."""
    from workers import runtime
    from workers.jobs.registry import get_job_kind

    executor, loop = _executor(cfg, self.app)
    rt = runtime.current()
    rec = asyncio.run_coroutine_threadsafe(executor.backend.get(job_id), loop).result()
    kind = get_job_kind(rec["kind"]) if rec is not None and rec["status"] == "queued" else None
    if kind is not None:
        limit = min(kind.concurrency, max(1, rt.capacity // 2)) if rt is not None else kind.concurrency
        if not _take_slot(kind.kind, limit):
            raise self.retry(countdown=BUSY_RETRY_S, max_retries=None)
    try:
        if rt is not None and rt.loop is loop:
            rt.run_task(executor.execute(job_id, token))  # (counted in the worker's heartbeat)
        else:
            asyncio.run_coroutine_threadsafe(executor.execute(job_id, token), loop).result()
    finally:
        if kind is not None:
            _free_slot(kind.kind)
