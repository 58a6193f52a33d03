"""``mmserve bench jobs``: job-queue throughput with several concurrent submitters.

Two job kinds:

- ``--kind sleep`` (default): a synthetic kind, ``bench.sleep`` (``--steps`` steps of ``--step-ms``
  each, one progress event per step): the queue's own overhead, and how it overlaps work.
- ``--kind images``: real ``images.generate`` jobs on ``--image`` (default the tiny DiT pipeline) at
  ``--size`` with ``--steps`` denoising steps and ``--n`` images per job. Each finished job's
  images are fetched by their URL and checked to be PNGs of the asked size.

The gateway is the real one (``mmserve serve`` options, uvicorn on a free loopback port, results in
a fresh directory). ``--dispatch local`` runs the jobs in the gateway process; ``--dispatch celery``
on ``--workers`` ``mmserve worker`` processes (``--modality embed`` for sleep jobs, ``--modality
diffusion --image ...`` for images; ``--worker-threads`` torch threads each) over Redis at
``--redis-url``, with a fresh key/queue prefix per run. ``--submitters`` clients each submit their
share of ``--jobs`` back to back (``POST /v1/jobs``) and follow each job to its end over SSE.

Reported: jobs/s and images/s (first submit to last result fetched), submit latency, queue wait and
run time P50/P99 (from the job's own timings), and errors (refused submissions, failed jobs,
missing or invalid images).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from gateway.argtypes import at_least
from workers.jobs import JobContext, register_job_kind


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
    ap.add_argument("--kind", choices=["sleep", "images"], default="sleep", help="synthetic or real image jobs")
    ap.add_argument("--dispatch", choices=["local", "celery"], default="local")
    ap.add_argument("--submitters", type=at_least(int, 1), default=8, help="concurrent submitting clients")
    ap.add_argument("--jobs", type=int, default=200, help="jobs in total")
    ap.add_argument("--steps", type=int, default=5, help="progress steps (sleep) or denoising steps (images)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="duration of a step (sleep)")
    ap.add_argument("--image", default="tiny-dit", help="image pipeline (images)")
    ap.add_argument("--size", default="64x64", help="image size (images)")
    ap.add_argument("--n", type=int, default=1, help="images per job (images)")
    ap.add_argument("--max-batch", type=int, default=8, help="--diffusion-max-batch of the engines (images)")
    ap.add_argument("--local-concurrency", type=int, default=64, help="sleep jobs run at once (local)")
    ap.add_argument("--workers", type=int, default=2, help="mmserve worker processes (celery)")
    ap.add_argument("--worker-concurrency", type=int, default=16, help="threads per worker (celery)")
    ap.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker (celery)")
    ap.add_argument("--redis-url", default=os.environ.get("MMSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class _Server:
    """uvicorn in a background thread on a free port."""

    def __init__(self, app: Any) -> None:
        import socket

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def _app(args: argparse.Namespace, prefix: str, results: str) -> Any:
    """The gateway as ``mmserve serve`` builds it (sleep jobs: ``--only diffusion`` with no pipeline
    builds no engine, only the job routes)."""
    from gateway.app import build_app
    from gateway.cli import build_parser

    argv = ["serve", "--results-dir", results, "--log-level", "warning"]
    if args.kind == "images":
        argv += ["--only", "diffusion", "--image", args.image, "--diffusion-max-batch", str(args.max_batch)]
    else:
        argv += ["--only", "diffusion"]
    if args.dispatch == "celery":
        argv += ["--dispatch", "celery", "--redis-url", args.redis_url, "--prefix", prefix]
    return build_app(build_parser().parse_args(argv))


def _start_workers(args: argparse.Namespace, prefix: str, log_dir: Path) -> list[Any]:
    from workers.local_cluster import start_worker, wait_for_heartbeats

    if args.kind == "images":
        modality, model_args = "diffusion", ["--image", args.image, "--diffusion-max-batch", str(args.max_batch)]
    else:
        modality, model_args = "embed", []
        os.environ["MMSERVE_JOB_MODULES"] = "bench.jobs"  # the workers register bench.sleep (inherited env)
    procs = [
        start_worker(
            modality,
            args.redis_url,
            prefix,
            model_args,
            worker_id=f"{prefix}-{i}",
            concurrency=args.worker_concurrency,
            threads=args.worker_threads,
            log_dir=log_dir,
        )
        for i in range(args.workers)
    ]
    try:
        wait_for_heartbeats(args.redis_url, prefix, procs, timeout_s=300)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def _png_ok(data: bytes, size: tuple[int, int]) -> bool:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # decodes every byte (verify() alone skips the pixel data)
            return img.format == "PNG" and img.size == size
    except Exception:  # noqa: BLE001 - anything unreadable is an invalid image
        return False


async def _follow(client: Any, job_id: str) -> dict[str, Any]:
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        async for _ in resp.aiter_lines():
            pass
    return (await client.get(f"/v1/jobs/{job_id}")).json()


async def _fetch_images(client: Any, job: dict[str, Any], size: tuple[int, int], want: int) -> int:
    """How many of ``job``'s images are missing or not PNGs of ``size`` (``want`` expected)."""
    data = (job.get("result") or {}).get("data") or []
    bad = max(0, want - len(data))
    for item in data:
        resp = await client.get(item["url"])
        bad += resp.status_code != 200 or not await asyncio.to_thread(_png_ok, resp.content, size)
    return bad


def _params(args: argparse.Namespace) -> dict[str, Any]:
    if args.kind == "sleep":
        return {"kind": "bench.sleep", "params": {"steps": args.steps, "step_ms": args.step_ms}}
    params = {"prompt": "a lighthouse at dusk", "size": args.size, "n": args.n, "steps": args.steps, "seed": 0}
    return {"kind": "images.generate", "params": params}


async def _drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    body = _params(args)
    width, height = (int(v) for v in args.size.lower().split("x"))
    submit_s: list[float] = []
    finals: list[dict[str, Any]] = []
    refused = bad_images = 0
    limits = httpx.Limits(max_connections=args.jobs + args.submitters + 8)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:

        async def one(job_id: str) -> None:
            nonlocal bad_images
            job = await _follow(client, job_id)
            finals.append(job)
            if args.kind == "images" and job["status"] == "succeeded":
                bad_images += await _fetch_images(client, job, (width, height), args.n)

        async def submitter(n: int, first_seed: int) -> None:
            nonlocal refused
            follows = []
            for i in range(n):
                if args.kind == "images":  # a distinct seed per job: no two jobs are the same work
                    body["params"] = {**body["params"], "seed": first_seed + i * args.n}
                t0 = time.perf_counter()
                resp = await client.post("/v1/jobs", json=body)
                submit_s.append(time.perf_counter() - t0)
                if resp.status_code != 202:
                    refused += 1
                    continue
                follows.append(asyncio.create_task(one(resp.json()["id"])))
            await asyncio.gather(*follows)

        shares = [args.jobs // args.submitters + (i < args.jobs % args.submitters) for i in range(args.submitters)]
        starts = [sum(shares[:i]) * args.n for i in range(len(shares))]
        start = time.perf_counter()
        await asyncio.gather(*(submitter(n, s) for n, s in zip(shares, starts, strict=True)))
        wall = time.perf_counter() - start
    done = [f for f in finals if f["status"] == "succeeded"]
    queue = [f["timings"]["queue_s"] for f in done]
    run = [f["timings"]["run_s"] for f in done]
    images = len(done) * args.n - bad_images if args.kind == "images" else 0
    return {
        "jobs": args.jobs,
        "succeeded": len(done),
        "errors": refused + len(finals) - len(done) + bad_images,
        "refused": refused,
        "failed": len(finals) - len(done),
        "bad_images": bad_images,
        "wall_s": wall,
        "jobs_per_s": len(done) / wall,
        "images_per_s": images / wall,
        "submit_p50_ms": _pct(submit_s, 50) * 1000,
        "submit_p99_ms": _pct(submit_s, 99) * 1000,
        "queue_p50_ms": _pct(queue, 50) * 1000,
        "queue_p99_ms": _pct(queue, 99) * 1000,
        "run_p50_ms": _pct(run, 50) * 1000,
        "run_p99_ms": _pct(run, 99) * 1000,
    }


def run_jobs(args: argparse.Namespace) -> dict[str, Any]:
    _register(args.local_concurrency)
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    results = tempfile.mkdtemp(prefix="mmserve-bench-jobs-")
    procs = _start_workers(args, prefix, Path(results)) if args.dispatch == "celery" else []
    try:
        with _Server(_app(args, prefix, results)) as url:
            figures = asyncio.run(_drive(url, args))
    finally:
        for p in procs:
            p.kill(signal.SIGTERM)
        if args.dispatch == "celery":
            import redis

            r = redis.Redis.from_url(args.redis_url)
            for key in r.scan_iter(f"{prefix}*"):
                r.delete(key)
        shutil.rmtree(results, ignore_errors=True)  # the generated images and the worker logs
    figures.update(
        kind=args.kind,
        dispatch=args.dispatch,
        submitters=args.submitters,
        steps=args.steps,
        workers=args.workers if args.dispatch == "celery" else 0,
        **(
            {"size": args.size, "n": args.n, "image": args.image}
            if args.kind == "images"
            else {"step_ms": args.step_ms}
        ),
    )
    what = (
        f"{args.steps} x {args.step_ms} ms" if args.kind == "sleep" else f"{args.n} x {args.size}, {args.steps} steps"
    )
    print(f"jobs ({args.kind}, {args.dispatch}, {args.submitters} submitters, {args.jobs} jobs of {what})")
    line = f"  {figures['succeeded']}/{args.jobs} succeeded, {figures['errors']} errors in {figures['wall_s']:.2f} s: "
    line += f"{figures['jobs_per_s']:.2f} jobs/s"
    if args.kind == "images":
        line += f", {figures['images_per_s']:.2f} images/s ({figures['bad_images']} invalid)"
    print(line)
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
