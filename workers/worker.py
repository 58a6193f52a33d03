"""``mmserve worker``: one modality's engines behind a Celery worker.

The engines are built by the modality's plugin from the same options as ``mmserve serve``, so a
gateway started with the same model options serves them under the same names. The Celery worker
uses the thread pool (``--concurrency`` calls at once: the engines batch concurrent calls
themselves, so a thread per call is what keeps their batches full) and consumes the modality
queue and its own worker queue. SIGTERM is a warm shutdown: the heartbeat says ``draining`` (the
gateway sends nothing new and resubmits what has not started), running calls finish, then the
heartbeat is withdrawn.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import uuid

from celery import signals

from engine.heap import freeze_startup_heap
from gateway.argtypes import at_least, log_level, positive, redis_url
from workers.celery_app import DEFAULT_PREFIX, make_celery, modality_queue, worker_queue

logger = logging.getLogger("mmserve.worker")


class _ResultsNotLogged(logging.Filter):
    """Celery logs each task's return value at INFO; mmserve's tasks return users' data (an
    ``audio.pipeline`` chain's transcript and reply), which stays out of the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, dict) and str(args.get("name", "")).startswith("mmserve.") and "return_value" in args:
            record.args = {**args, "return_value": "(not logged)"}
        return True


def hide_task_results() -> None:
    """Install ``_ResultsNotLogged`` on Celery's task-trace logger (once)."""
    trace = logging.getLogger("celery.app.trace")
    if not any(isinstance(f, _ResultsNotLogged) for f in trace.filters):
        trace.addFilter(_ResultsNotLogged())


def default_concurrency(args: argparse.Namespace) -> int:
    """Calls at once (a thread each): an LLM worker's batch; a speech worker's bound of requests
    held (``--tts-max-requests``, ``--asr-max-requests``) and a few jobs or live turns past it, so
    that the bound, not the pool, refuses the routes' requests (a call past the pool waits in the
    queue, and a 503 after a minute); else 16."""
    if args.modality == "llm":
        return getattr(args, "max_num_seqs", None) or 64
    bound = getattr(args, f"{args.modality}_max_requests", None)
    return max(16, bound + 8) if bound else 16


def check_redis(url: str, wait_s: float) -> None:
    """``ConnectionError`` (one line, no password) unless Redis at ``url`` answers (its DB too):
    an unreachable one is tried again for ``wait_s`` (a Redis still starting beside the worker),
    a refusal (a DB index out of range, a wrong password) ends it at once."""
    import redis

    from workers.wire import redis_where

    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    where = redis_where(url)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                client.ping()
                return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"cannot reach Redis at {where} (--redis-url): {exc}") from None
                logger.warning("Redis at %s is unreachable (%s); trying again", where, exc)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            except redis.exceptions.RedisError as exc:
                raise ConnectionError(f"Redis at {where} refused the worker (--redis-url): {exc}") from None
    finally:
        client.close()


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """``mmserve worker`` options besides the plugins' model options."""
    from gateway.plugins import MODALITIES

    parser.add_argument("--modality", required=True, choices=MODALITIES)
    parser.add_argument(
        "--concurrency",
        type=at_least(int, 1),
        default=None,
        help="calls run at once (threads; default: --max-num-seqs or 64 for llm, so batches fill; for tts and asr "
        "their --*-max-requests bound plus 8, at least 16, so that the bound refuses; 16 otherwise)",
    )
    parser.add_argument(
        "--redis-url", type=redis_url, default=os.environ.get("MMSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument(
        "--redis-wait-s",
        type=at_least(float, 0),
        default=30.0,
        help="at start-up, how long to wait for an unreachable Redis before exiting (before loading models)",
    )
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="queue and key prefix (one per cluster)")
    parser.add_argument("--worker-id", default=None, help="default: <modality>-<host>-<pid>-<random>")
    parser.add_argument("--heartbeat-s", type=positive, default=1.0, help="load report period (TTL: 3x)")
    parser.add_argument(
        "--allow-root",
        action="store_true",
        help="run as root although tasks are pickled (Celery refuses otherwise; trusted clusters only)",
    )
    parser.add_argument("--log-level", type=log_level, default="info")


def run_worker(args: argparse.Namespace) -> int:
    """Build the engines, start them, and consume Celery tasks until told to stop."""
    from gateway import plugins
    from workers.runtime import WorkerRuntime

    if hasattr(os, "geteuid") and os.geteuid() == 0 and not os.environ.get("C_FORCE_ROOT"):
        if not args.allow_root:
            print(
                "mmserve worker: refusing to run as root with pickled tasks; run as another user, "
                "or pass --allow-root if only trusted clients can reach Redis",
                file=sys.stderr,
            )
            return 2
        os.environ["C_FORCE_ROOT"] = "1"  # Celery's own check; the user accepted it above
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hide_task_results()
    check_redis(args.redis_url, args.redis_wait_s)  # before the models load: a wrong URL is one line
    args.only = [args.modality]
    built = plugins.build_all(args)
    if not built.engines:
        print(f"mmserve worker: no {args.modality} engine to serve (check the model options)", file=sys.stderr)
        return 2
    if args.concurrency is None:
        args.concurrency = default_concurrency(args)
    worker_id = args.worker_id or f"{args.modality}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    rt = WorkerRuntime(
        worker_id,
        args.modality,
        built.engines,
        args.redis_url,
        prefix=args.prefix,
        capacity=args.concurrency,
        heartbeat_s=args.heartbeat_s,
    )
    rt.start()
    freeze_startup_heap()  # engine.heap: full collections skip the loaded models' objects
    logger.info("worker %s serving %s", worker_id, ", ".join(built.engines))
    app = make_celery(args.redis_url)

    def drain(**_: object) -> None:  # warm shutdown (SIGTERM): the gateway stops routing here
        rt.drain()

    signals.worker_shutting_down.connect(drain, weak=False)
    exitcode = 0
    try:
        while True:
            worker = app.Worker(
                hostname=f"{worker_id}@{socket.gethostname()}",
                queues=[modality_queue(args.modality, args.prefix), worker_queue(worker_id, args.prefix)],
                pool="threads",
                concurrency=args.concurrency,
                loglevel=args.log_level.upper(),
                without_gossip=True,
                without_mingle=True,
                without_heartbeat=True,
            )
            worker.start()
            exitcode = int(worker.exitcode or 0)
            if rt.draining or exitcode == 0:
                break
            # Celery gives up on some broker-connection races (e.g. an ack while Redis restarts);
            # the engines are fine, so only the consumer is started again.
            logger.error("the Celery consumer stopped (exit code %d); restarting it", exitcode)
            time.sleep(1.0)
    finally:
        rt.stop()
    return exitcode
