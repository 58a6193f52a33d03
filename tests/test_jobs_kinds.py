"""Job kinds used by the job tests (pure logic: counting steps). Imported by the test process and,
through ``MMSERVE_JOB_MODULES``, by the Celery workers the tests start. No tests here."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from workers.jobs import JobCancelled, JobContext, ParamError, register_job_kind

RUNS: Counter[str] = Counter()  # executions per params["tag"] in this process


async def steps(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """``steps`` steps of ``delay`` seconds, a progress event (with a 1-byte preview) after each,
    then a text result file."""
    RUNS[params.get("tag", "")] += 1
    n = int(params.get("steps", 3))
    for i in range(n):
        await asyncio.sleep(float(params.get("delay", 0.01)))
        ctx.progress(i + 1, n, preview=bytes([i % 256]))
    if params.get("fail"):
        raise RuntimeError("boom")
    url = ctx.store.put(ctx.job_id, "out.txt", f"{n} steps, attempt {ctx.attempt}".encode(), "text/plain")
    return {"steps": n, "url": url, "attempt": ctx.attempt}


def sync_steps(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """The same on a worker thread (cooperative cancellation through ``check_cancelled``)."""
    RUNS[params.get("tag", "")] += 1
    n = int(params.get("steps", 3))
    for i in range(n):
        time.sleep(float(params.get("delay", 0.01)))
        ctx.check_cancelled()
        ctx.progress(i + 1, n)
    return {"steps": n}


async def flaky(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Fails its first ``fail_attempts`` attempts (a kind registered with ``retry_on_error``), or
    at once on its input when ``bad_input`` is set."""
    if params.get("bad_input"):
        raise ParamError("bad_input", "this input can't be processed")
    if ctx.attempt <= int(params.get("fail_attempts", 1)):
        raise RuntimeError(f"flaky attempt {ctx.attempt}")
    return {"attempt": ctx.attempt}


async def partial_file(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Runs until cancelled, then writes what it did (``partial.txt``, after ``finish_s``) and
    keeps it as a batch does."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(float(params.get("finish_s", 0.3)))
        ctx.store.put(ctx.job_id, "partial.txt", b"what was done", "text/plain")
        raise JobCancelled("cancelled", result={"partial": True}) from None
    return {}


def validate(params: dict[str, Any], engines: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(params.get("steps", 3), int) or not 0 < params.get("steps", 3) <= 10_000:
        raise ValueError("steps must be an integer in [1, 10000]")
    return params


register_job_kind("test.steps", "embed", steps, validate=validate, concurrency=4)
register_job_kind("test.sync_steps", "embed", sync_steps, validate=validate, concurrency=2)
register_job_kind("test.flaky", "embed", flaky, retry_on_error=True)
register_job_kind("test.partial_file", "embed", partial_file)
