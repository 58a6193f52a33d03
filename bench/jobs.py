"""``mmserve bench jobs``: job-queue throughput with several concurrent submitters.

Starts the job routes in this process (uvicorn on a free loopback port) with a synthetic job kind,
``bench.sleep`` (``steps`` steps of ``step_ms`` each, one progress event per step), and either
runs the jobs there (``--dispatch local``: ``--local-concurrency`` at once) or on ``--workers``
``mmserve worker --modality embed`` processes (``--dispatch celery``, Redis at ``--redis-url``, a
fresh key/queue prefix per run). ``--submitters`` clients each submit their share of ``--jobs``
back to back (``POST /v1/jobs``) and follow each job to its end over SSE.

Reported: submit latency P50/P99, end-to-end jobs/s (first submit to last job done), queue wait
and run time P50/P99 (from the job's own timings), and errors. With ``steps x step_ms`` near 0
this measures the queue's overhead; raise them to see how it overlaps real work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from workers.jobs import JobContext, register_job_kind

REPO_ROOT = Path(__file__).resolve().parents[1]


async def _sleep_job(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    steps = int(params.get("steps", 1))
    for i in range(steps):
        await asyncio.sleep(float(params.get("step_ms", 0)) / 1000)
        ctx.progress(i + 1, steps)
    return {"steps": steps}


def _register(concurrency: int) -> None:
    register_job_kind("bench.sleep", "embed", _sleep_job, concurrency=concurrency)


_register(64)  # also imported by the workers (MMSERVE_JOB_MODULES=bench.jobs)


def add_jobs_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dispatch", choices=["local", "celery"], default="local")
    ap.add_argument("--submitters", type=int, default=8, help="concurrent submitting clients")
    ap.add_argument("--jobs", type=int, default=200, help="jobs in total")
    ap.add_argument("--steps", type=int, default=5, help="progress steps per job")
    ap.add_argument("--step-ms", type=float, default=10.0, help="duration of a step")
    ap.add_argument("--local-concurrency", type=int, default=64, help="jobs run at once (local)")
    ap.add_argument("--workers", type=int, default=2, help="mmserve worker processes (celery)")
    ap.add_argument("--worker-concurrency", type=int, default=16, help="threads per worker (celery)")
    ap.add_argument("--redis-url", default=os.environ.get("MMSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class _Server:
    """uvicorn in a background thread on a free port."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _start_workers(args: argparse.Namespace, prefix: str) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "MMSERVE_JOB_MODULES": "bench.jobs", "PYTHONPATH": str(REPO_ROOT)}
    procs = []
    for _ in range(args.workers):
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "worker",
            "--modality",
            "embed",
            "--redis-url",
            args.redis_url,
            "--prefix",
            prefix,
            "--concurrency",
            str(args.worker_concurrency),
            "--log-level",
            "warning",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env))
    import redis

    from workers.wire import Keys

    r = redis.Redis.from_url(args.redis_url)
    deadline = time.monotonic() + 180
    while len(r.keys(Keys(prefix).worker_pattern)) < args.workers:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("the workers did not start")
        time.sleep(0.2)
    return procs


async def _follow(client: Any, job_id: str) -> dict[str, Any]:
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        async for _ in resp.aiter_lines():
            pass
    return (await client.get(f"/v1/jobs/{job_id}")).json()


async def _drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    body = {"kind": "bench.sleep", "params": {"steps": args.steps, "step_ms": args.step_ms}}
    submit_s: list[float] = []
    finals: list[dict[str, Any]] = []
    errors = 0
    limits = httpx.Limits(max_connections=args.jobs + args.submitters + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def submitter(n: int) -> None:
            nonlocal errors
            follows = []
            for _ in range(n):
                t0 = time.perf_counter()
                resp = await client.post("/v1/jobs", json=body)
                submit_s.append(time.perf_counter() - t0)
                if resp.status_code != 202:
                    errors += 1
                    continue
                follows.append(asyncio.create_task(_follow(client, resp.json()["id"])))
            finals.extend(await asyncio.gather(*follows))

        shares = [args.jobs // args.submitters + (i < args.jobs % args.submitters) for i in range(args.submitters)]
        start = time.perf_counter()
        await asyncio.gather(*(submitter(n) for n in shares))
        wall = time.perf_counter() - start
    done = [f for f in finals if f["status"] == "succeeded"]
    queue = [f["timings"]["queue_s"] for f in done]
    run = [f["timings"]["run_s"] for f in done]
    return {
        "jobs": args.jobs,
        "succeeded": len(done),
        "errors": errors + len(finals) - len(done),
        "wall_s": wall,
        "jobs_per_s": len(done) / wall,
        "submit_p50_ms": _pct(submit_s, 50) * 1000,
        "submit_p99_ms": _pct(submit_s, 99) * 1000,
        "queue_p50_ms": _pct(queue, 50) * 1000,
        "queue_p99_ms": _pct(queue, 99) * 1000,
        "run_p50_ms": _pct(run, 50) * 1000,
        "run_p99_ms": _pct(run, 99) * 1000,
    }


def run_jobs(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from gateway.app import create_app
    from workers.jobs.plugin import router
    from workers.jobs.runner import JobsConfig, JobService

    _register(args.local_concurrency)
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    results = tempfile.mkdtemp(prefix="mmserve-bench-jobs-")
    cfg = JobsConfig(
        dispatch=args.dispatch,
        redis_url=args.redis_url,
        key_prefix=f"{prefix}:jobs",
        queue_prefix=prefix,
        store={"type": "local", "root": results},
    )
    procs = _start_workers(args, prefix) if args.dispatch == "celery" else []
    app = create_app({}, routers=[router])
    app.state.jobs = JobService(cfg, app.state.engines)
    try:
        with _Server(app) as url:
            figures = asyncio.run(_drive(url, args))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if args.dispatch == "celery":
            import redis

            r = redis.Redis.from_url(args.redis_url)
            for key in r.scan_iter(f"{prefix}*"):
                r.delete(key)
    figures.update(
        dispatch=args.dispatch,
        submitters=args.submitters,
        steps=args.steps,
        step_ms=args.step_ms,
        workers=args.workers if args.dispatch == "celery" else 0,
    )
    print(f"jobs ({args.dispatch}, {args.submitters} submitters, {args.jobs} jobs of {args.steps} x {args.step_ms} ms)")
    print(
        f"  {figures['succeeded']}/{args.jobs} succeeded, {figures['errors']} errors in {figures['wall_s']:.2f} s: "
        f"{figures['jobs_per_s']:.1f} jobs/s"
    )
    for what in ("submit", "queue", "run"):
        print(f"  {what:<7} P50 {figures[f'{what}_p50_ms']:8.1f} ms   P99 {figures[f'{what}_p99_ms']:8.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmserve bench jobs", description=__doc__.split("\n\n")[0])
    add_jobs_args(ap)
    args = ap.parse_args(argv)
    figures = run_jobs(args)
    return 0 if figures["errors"] == 0 and figures["succeeded"] == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
