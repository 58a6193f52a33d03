"""``mmserve bench cluster``: a ``--dispatch celery`` cluster on loopback under a steady request rate,
optionally with faults injected mid-run.

It starts a private ``redis-server``, ``--workers`` LLM workers and a gateway (all subprocesses),
then fires streamed completions at ``--rate`` req/s (fixed spacing) for ``--duration`` seconds.
``--kill-worker-at S`` SIGKILLs one worker S seconds in; ``--redis-outage-at S`` stops Redis for
``--redis-outage-s`` seconds. Every request ends in one of:

- ``ok``: streamed to ``[DONE]`` without an error event;
- ``error``: an HTTP error answer or an SSE error event (e.g. 503 while Redis is down,
  ``worker_lost`` when its worker died mid-stream): accepted and answered, with an error;
- ``lost``: no answer (timeout, dropped connection, stream cut without ``[DONE]``). Must be 0.

Reported: counts by outcome and status, TTFT/end-to-end percentiles of ``ok`` requests, latency of
the 503 answers, retries the gateway made. Example (tiny model, tiny load)::

    mmserve bench cluster --rate 2 --duration 20 --kill-worker-at 8 --redis-outage-at 14
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.report import percentiles, print_table, save_result, versions_of
from workers.local_cluster import RedisServer, WorkerProc, free_port, start_worker, wait_for_heartbeats

SYSTEMS = [f"You are assistant number {i}. Answer briefly and politely, in plain English." for i in range(4)]


@dataclass
class Outcome:
    kind: str  # ok | error | lost
    status: int
    start: float  # seconds since the run began
    ttft: float | None
    e2e: float
    detail: str = ""


def add_cluster_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llm", default=None, help="model for the workers (default: the tiny test llama)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8, help="calls per worker")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (fixed spacing)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kill-worker-at", type=float, default=None, help="SIGKILL one worker this many seconds in")
    ap.add_argument("--redis-outage-at", type=float, default=None, help="stop Redis this many seconds in")
    ap.add_argument("--redis-outage-s", type=float, default=3.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--out", type=Path, default=None, help="JSON result file")


async def _request(client: httpx.AsyncClient, url: str, body: dict[str, Any], t_run: float) -> Outcome:
    t0 = time.perf_counter()
    start, ttft = t0 - t_run, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return Outcome("error", resp.status_code, start, None, time.perf_counter() - t0, text[:200])
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return Outcome("ok", 200, start, ttft, time.perf_counter() - t0)
                msg = json.loads(line[6:])
                if "error" in msg:
                    code = str(msg["error"].get("code"))
                    return Outcome("error", 200, start, ttft, time.perf_counter() - t0, f"in-stream {code}")
                if ttft is None:
                    ttft = time.perf_counter() - t0
        return Outcome("lost", 200, start, ttft, time.perf_counter() - t0, "stream ended without [DONE]")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Outcome("lost", 0, start, ttft, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")


async def _faults(args: argparse.Namespace, workers: list[WorkerProc], redis: RedisServer, log: list[str]) -> None:
    t0 = time.perf_counter()
    events = []
    if args.kill_worker_at is not None:
        events.append((args.kill_worker_at, "kill"))
    if args.redis_outage_at is not None:
        events.append((args.redis_outage_at, "redis"))
    for at, what in sorted(events):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        if what == "kill":
            workers[0].kill(signal.SIGKILL)
            log.append(f"{time.perf_counter() - t0:.1f}s: SIGKILL worker {workers[0].worker_id}")
        else:
            await asyncio.to_thread(redis.stop)
            log.append(f"{time.perf_counter() - t0:.1f}s: Redis stopped")
            await asyncio.sleep(args.redis_outage_s)
            await asyncio.to_thread(redis.start)
            log.append(f"{time.perf_counter() - t0:.1f}s: Redis restarted")


async def _load(args: argparse.Namespace, base: str, workers: list[WorkerProc], redis: RedisServer) -> dict[str, Any]:
    url = f"{base}/v1/completions"
    n = max(1, int(args.rate * args.duration))
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=64)
    fault_log: list[str] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        t_run = time.perf_counter()
        faults = asyncio.create_task(_faults(args, workers, redis, fault_log))

        async def fire(i: int) -> Outcome:
            await asyncio.sleep(i / args.rate)
            prompt = f"{SYSTEMS[i % len(SYSTEMS)]} Question {i}: what is {i} plus {i}?"
            body = {
                "model": "default",
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
            }
            return await _request(client, url, body, t_run)

        outcomes = await asyncio.gather(*(fire(i) for i in range(n)))
        wall = time.perf_counter() - t_run
        await faults
        metrics = (await client.get(f"{base}/metrics")).text
    retries = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if "dispatch_retries_total" in line and not line.startswith("#")
    )
    return {"outcomes": outcomes, "wall_s": wall, "fault_log": fault_log, "retries": retries}


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s (log: {log})")
        time.sleep(0.5)


def run_cluster(args: argparse.Namespace) -> dict[str, Any]:
    if args.llm is None:
        from engine.tiny_models import tiny_model_dir

        args.llm = str(tiny_model_dir("llama"))
    logs = Path(tempfile.mkdtemp(prefix="mmserve-bench-cluster-"))
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    redis = RedisServer()
    redis.start()
    model_args = ["--llm", args.llm, "--served-model-name", "default"]
    workers = [
        start_worker("llm", redis.url(), prefix, model_args, worker_id=f"{prefix}-w{i}", concurrency=args.concurrency,
                     log_dir=logs, threads=args.threads)
        for i in range(args.workers)
    ]  # fmt: skip
    port = free_port()
    gw_log = logs / "gateway.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--dispatch", "celery", "--only", "llm", *model_args,
           "--redis-url", redis.url(), "--prefix", prefix, "--port", str(port), "--log-level", "warning"]  # fmt: skip
    gateway: subprocess.Popen[bytes] | None = None
    try:
        wait_for_heartbeats(redis.url(), prefix, workers, timeout_s=300)
        with open(gw_log, "wb") as out:
            gateway = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/ready", gateway, gw_log)
        print(f"cluster up: {args.workers} workers, gateway {base} (logs: {logs})", file=sys.stderr)
        run = asyncio.run(_load(args, base, workers, redis))
    finally:
        if gateway is not None:
            gateway.send_signal(signal.SIGTERM)
            try:
                gateway.wait(30)
            except subprocess.TimeoutExpired:
                gateway.kill()
        for w in workers:
            w.kill(signal.SIGKILL)
        redis.stop()
    return _report(args, run, logs)


def _report(args: argparse.Namespace, run: dict[str, Any], logs: Path) -> dict[str, Any]:
    outcomes: list[Outcome] = run["outcomes"]
    ok = [o for o in outcomes if o.kind == "ok"]
    err503 = [o for o in outcomes if o.kind == "error" and o.status == 503]
    kinds = Counter(o.kind for o in outcomes)
    details = Counter(f"{o.status} {o.detail.split(':')[0][:60]}" for o in outcomes if o.kind != "ok")
    ms = 1000.0
    summary = {
        "requests": len(outcomes),
        "rate_req_s": args.rate,
        "achieved_req_s": round(len(outcomes) / run["wall_s"], 2),
        "ok": kinds["ok"],
        "errors": kinds["error"],
        "lost": kinds["lost"],
        "gateway_retries": run["retries"],
        "ttft_ms": percentiles([o.ttft * ms for o in ok if o.ttft is not None]),
        "e2e_ms": percentiles([o.e2e * ms for o in ok]),
        "http503_ms": percentiles([o.e2e * ms for o in err503]),
        "non_ok_by_kind": dict(details),
        "faults": run["fault_log"],
    }
    rows = [
        {"metric": "requests (ok/errors/lost)", "value": f"{kinds['ok']}/{kinds['error']}/{kinds['lost']}"},
        {"metric": "achieved req/s", "value": summary["achieved_req_s"]},
        {"metric": "gateway retries", "value": run["retries"]},
        *({"metric": f"{name} {p}", "value": None if v is None else round(v, 1)}
          for name in ("ttft_ms", "e2e_ms", "http503_ms") for p, v in summary[name].items() if p in ("p50", "p99")),
    ]  # fmt: skip
    print_table(rows, ["metric", "value"])
    for line in run["fault_log"]:
        print(f"fault: {line}")
    for what, count in details.items():
        print(f"non-ok: {count} x {what}")
    result = {
        "bench": "cluster",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summary,
        "outcomes": [asdict(o) for o in outcomes],
        "versions": versions_of(),
        "logs": str(logs),
    }
    if args.out is not None:
        save_result(result, args.out)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmserve bench cluster", description=__doc__.split("\n")[0])
    add_cluster_args(ap)
    args = ap.parse_args(argv)
    result = run_cluster(args)
    return 1 if result["summary"]["lost"] else 0
